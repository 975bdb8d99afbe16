"""Rank-side checks for the tensor-parallel tests: each returns plain numbers the test asserts on.

Every check builds the one-process reference in the same rank from the same seed and compares the
tensor-parallel model with it step by step, so a spawn of a few ranks runs many checks.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.nn.functional as F

import meshwise
from meshwise.comm.api import Communicator
from meshwise.comm.counting import CountingCommunicator
from meshwise.comm.mesh import Mesh, MeshShape
from meshwise.models.gpt import GPT, GPTConfig, language_model_loss
from meshwise.models.gpt_activations import layer_activation_report
from meshwise.models.gpt_plan import tensor_parallel
from meshwise.parallel import DataParallel
from meshwise.parallel.tensor_parallel import (
    copy_to_region,
    full_tensors,
    gather_from_sequence,
    gather_last,
    reduce_from_region,
    scatter_to_sequence,
    split_last,
    vocab_parallel_cross_entropy,
)
from meshwise.parallel.tensor_parallel.regions import gathered_linears


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def gpt_parity(
    config: GPTConfig,
    tp_comm: Communicator,
    *,
    sequence_parallel: bool,
    dp_comm: Communicator | None = None,
    steps: int = 3,
    batch: int = 4,
) -> dict[str, float]:
    """Max |TP − reference| over ``steps`` AdamW steps of logits, loss, every gradient and every weight.

    With ``dp_comm`` the batch is split across its ranks and the TP model is wrapped in DataParallel;
    the reference always trains on the whole batch.
    """
    torch.manual_seed(0)
    reference = GPT(config)
    model = tensor_parallel(copy.deepcopy(reference), tp_comm, sequence_parallel=sequence_parallel)
    dp_rank, dp_size = (dp_comm.rank, dp_comm.world_size) if dp_comm else (0, 1)
    wrapped = DataParallel(model, dp_comm) if dp_comm else model
    # Adam divides each gradient by its own magnitude, so it turns rounding differences of gradients near
    # eps into weight differences of up to lr. eps=1e-6: k's bias has an analytically zero gradient (softmax
    # ignores a shift shared by all keys), pure rounding noise (~1e-11) that eps=1e-8 would amplify to
    # ~lr/1000 per step; lr=1e-3 (GPT-2-like) bounds the rest.
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    diffs = {"logits": 0.0, "loss": 0.0, "grads": 0.0, "weights": 0.0}
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, config.vocab, (batch, config.seq_len + 1), generator=data)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        ref_logits = reference(inputs)
        ref_loss = language_model_loss(ref_logits, targets)
        ref_opt.zero_grad()
        ref_loss.backward()
        mine = slice(dp_rank * batch // dp_size, (dp_rank + 1) * batch // dp_size)
        logits = wrapped(inputs[mine])
        loss = vocab_parallel_cross_entropy(logits, targets[mine], tp_comm, vocab=config.vocab)
        opt.zero_grad()
        loss.backward()
        full_logits = gather_last(logits.detach(), tp_comm)[..., : config.vocab]
        diffs["logits"] = max(diffs["logits"], (full_logits - ref_logits[mine]).abs().max().item())
        if dp_comm is None:
            diffs["loss"] = max(diffs["loss"], abs(loss.item() - ref_loss.item()))
        diffs["grads"] = max(
            diffs["grads"],
            _max_diff(
                full_tensors(model, tp_comm, grads=True), {n: p.grad for n, p in reference.named_parameters()}
            ),
        )
        ref_opt.step()
        opt.step()
        diffs["weights"] = max(
            diffs["weights"], _max_diff(full_tensors(model, tp_comm), dict(reference.named_parameters()))
        )
    return diffs


def region_ops(comm: Communicator) -> dict[str, float]:
    """Each region op's forward and backward against its definition, built from every rank's inputs
    (rank r's input and upstream gradient are seeded by r, so every rank can compute all of them)."""
    t, me = comm.world_size, comm.rank

    def per_rank(shape: tuple[int, ...], salt: int) -> list[torch.Tensor]:
        return [torch.randn(shape, generator=torch.Generator().manual_seed(salt + r)) for r in range(t)]

    def run(op, shape_in: tuple[int, ...], shape_out: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        x = per_rank(shape_in, 0)
        grads = per_rank(shape_out, 100)
        mine = x[me].clone().requires_grad_(True)
        y = op(mine)
        y.backward(grads[me])
        return y.detach(), mine.grad, x, grads

    diffs = {}
    full, shard = (2, 2 * t, 3), (2, 2, 3)
    cases = {
        "copy_to_region": (lambda v: copy_to_region(v, comm), full, full, lambda x, g: (x[me], sum(g))),
        "reduce_from_region": (
            lambda v: reduce_from_region(v, comm),
            full,
            full,
            lambda x, g: (sum(x), g[me]),
        ),
        "gather_from_sequence": (
            lambda v: gather_from_sequence(v, comm),
            shard,
            full,
            lambda x, g: (torch.cat(x, 1), sum(g).chunk(t, 1)[me]),
        ),
        "scatter_to_sequence": (
            lambda v: scatter_to_sequence(v, comm),
            full,
            shard,
            lambda x, g: (sum(x).chunk(t, 1)[me], torch.cat(g, 1)),
        ),
        "split_last": (
            lambda v: split_last(v, comm),
            (2, 3, 2 * t),
            (2, 3, 2),
            lambda x, g: (x[me].chunk(t, -1)[me], torch.cat(g, -1)),
        ),
        "gather_last": (
            lambda v: gather_last(v, comm),
            (2, 3, 2),
            (2, 3, 2 * t),
            lambda x, g: (torch.cat(x, -1), g[me].chunk(t, -1)[me]),
        ),
    }
    for name, (op, shape_in, shape_out, expect) in cases.items():
        y, grad, x, grads = run(op, shape_in, shape_out)
        want_y, want_grad = expect(x, grads)
        diffs[name] = max((y - want_y).abs().max().item(), (grad - want_grad).abs().max().item())
    weights = per_rank((5, 3), 200)  # rank r's column shard of a (5t × 3) weight
    w = weights[me].clone().requires_grad_(True)
    y, grad, x, grads = run(lambda v: gathered_linears(v, comm, [(w, None)])[0], shard, (2, 2 * t, 5))
    want_grad = sum(g @ wr for g, wr in zip(grads, weights, strict=True)).chunk(t, 1)[me]
    want_w = grads[me].reshape(-1, 5).t() @ torch.cat(x, 1).reshape(-1, 3)
    diffs["gathered_linears"] = max(
        (y - torch.cat(x, 1) @ weights[me].t()).abs().max().item(),
        (grad - want_grad).abs().max().item(),
        (w.grad - want_w).abs().max().item(),
    )
    return diffs


def counting_wrapper(comm: Communicator) -> dict[str, dict]:
    """What a CountingCommunicator records for p2p, async and split groups (each group its own stats)."""
    counting = CountingCommunicator(comm)
    x = torch.ones(10)
    last = comm.world_size - 1
    if comm.rank == 0:
        counting.send(x, last)
    elif comm.rank == last:
        counting.recv(x, 0)
    counting.all_reduce(x, async_op=True).wait()
    child = counting.split(list(range(comm.world_size)))
    assert child is not None
    child.broadcast(x, 0)
    child.close()
    return {"parent": counting.stats.as_dict(), "child": child.stats.as_dict()}


def dropout_masks(config: GPTConfig, comm: Communicator) -> dict[str, bool]:
    """Whether dropout masks agree across the tp ranks: they must where activations are replicated (the
    residual stream without SP, so replicas stay equal) and must not where ranks hold different heads or
    tokens (attention, the residual stream under SP)."""
    config = replace(config, dropout=0.5)
    result = {}
    for sp in (False, True):
        torch.manual_seed(comm.rank)  # ranks start from different random states: conversion aligns them
        model = tensor_parallel(GPT(config), comm, sequence_parallel=sp).train()
        ones = torch.ones(2, 8, config.hidden)
        masks = gather_last(model.blocks[0].dropout(ones).eq(0).float(), comm).chunk(comm.world_size, -1)
        result[f"residual equal, sp={sp}"] = all(torch.equal(masks[0], m) for m in masks[1:])
        x = torch.randn(2, 8 // (comm.world_size if sp else 1), config.hidden)
        hidden = model.blocks[0](x)
        if not sp:
            replicas = gather_last(hidden.detach(), comm).chunk(comm.world_size, -1)
            result["replicas equal after a block"] = all(torch.equal(replicas[0], r) for r in replicas[1:])
    attention = model.blocks[0].attn
    q = torch.ones(1, 4, attention.q.weight.shape[0])
    with attention.random.active():
        probe = torch.nn.functional.dropout(q, 0.5).eq(0).float()
    probes = gather_last(probe, comm).chunk(comm.world_size, -1)
    result["attention masks differ"] = not torch.equal(probes[0], probes[1])
    return result


def cross_entropy_parity(comm: Communicator, vocab: int) -> dict[str, float]:
    """vocab_parallel_cross_entropy vs F.cross_entropy: values and gradients, ignored targets, smoothing."""
    generator = torch.Generator().manual_seed(7)
    padded = -(-vocab // comm.world_size) * comm.world_size
    full = torch.randn(6, 5, vocab, generator=generator) * 3
    targets = torch.randint(0, vocab, (6, 5), generator=generator)
    targets[0, :3] = -100
    targets[4, 1] = -100
    diffs = {}
    for smoothing in (0.0, 0.1):
        for reduction in ("mean", "none"):
            reference = full.clone().requires_grad_(True)
            expected = F.cross_entropy(
                reference.transpose(1, 2), targets, label_smoothing=smoothing, reduction=reduction
            )
            expected.sum().backward()
            padded_full = torch.cat([full, torch.full((6, 5, padded - vocab), 5.0)], dim=-1)
            local = padded_full.chunk(comm.world_size, dim=-1)[comm.rank].clone().requires_grad_(True)
            got = vocab_parallel_cross_entropy(
                local, targets, comm, vocab=vocab, label_smoothing=smoothing, reduction=reduction
            )
            got.sum().backward()
            grad = gather_last(local.grad, comm)
            key = f"smoothing={smoothing},{reduction}"
            diffs[key + ":value"] = (got - expected).abs().max().item()
            diffs[key + ":grad"] = (grad[..., :vocab] - reference.grad).abs().max().item()
            diffs[key + ":padded_grad"] = grad[..., vocab:].abs().max().item() if padded > vocab else 0.0
    return diffs


def block_traffic(config: GPTConfig, tp_comm: Communicator, *, sequence_parallel: bool) -> dict[str, dict]:
    """Calls and bytes one transformer layer sends over the tp group, forward and backward separately,
    and for a whole training step of the model."""
    counting = CountingCommunicator(tp_comm)
    torch.manual_seed(0)
    model = tensor_parallel(GPT(config), counting, sequence_parallel=sequence_parallel)
    batch, seq = 2, config.seq_len
    local_seq = seq // tp_comm.world_size if sequence_parallel else seq
    x = torch.randn(batch, local_seq, config.hidden, requires_grad=True)
    counting.stats.reset()
    y = model.blocks[0](x)
    forward = counting.stats.as_dict()
    counting.stats.reset()
    y.sum().backward()
    backward = counting.stats.as_dict()
    counting.stats.reset()
    tokens = torch.randint(0, config.vocab, (batch, seq + 1))
    logits = model(tokens[:, :-1])
    vocab_parallel_cross_entropy(logits, tokens[:, 1:], counting, vocab=config.vocab).backward()
    step = counting.stats.as_dict()
    return {"forward": forward, "backward": backward, "step": step}


def sequence_length_error(config: GPTConfig, tp_comm: Communicator) -> str:
    """The message of a sequence-parallel forward over a sequence that does not split ``tp`` ways."""
    model = tensor_parallel(GPT(config), tp_comm, sequence_parallel=True)
    try:
        model(torch.zeros(1, tp_comm.world_size + 1, dtype=torch.long))
    except ValueError as exc:
        return str(exc)
    return ""


def run_checks(configs: dict[str, GPTConfig], steps: int, mesh_shape: MeshShape | None = None) -> dict:
    """On a world that is one tp group: parity with and without SP, cross-entropy, traffic, errors; then,
    with ``mesh_shape``, tp inside ``mesh.tp`` and DataParallel across ``mesh.dp`` against the full-batch
    reference."""
    world = meshwise.init(backend="gloo", timeout=60)  # a mismatch fails in 60 s, naming rank and op
    try:
        comm = world.comm
        results: dict = {}
        for name, config in configs.items():
            for sp in (False, True):
                results[f"{name}:sp={sp}"] = gpt_parity(config, comm, sequence_parallel=sp, steps=steps)
        results["cross_entropy"] = cross_entropy_parity(comm, vocab=13)
        results["regions"] = region_ops(comm)
        results["counting"] = counting_wrapper(comm)
        results["dropout"] = dropout_masks(next(iter(configs.values())), comm)
        config = next(iter(configs.values()))
        results["traffic"] = {sp: block_traffic(config, comm, sequence_parallel=sp) for sp in (False, True)}
        results["seq_error"] = sequence_length_error(config, comm)
        results["memory"] = layer_activation_report(replace(config, dropout=0.1), comm, batch=2)
        if mesh_shape is not None:
            mesh = Mesh(comm, mesh_shape)
            counted = mesh.map_axes(CountingCommunicator)  # every axis's traffic, the mesh still owns them
            for sp in (False, True):
                results[f"mesh:sp={sp}"] = gpt_parity(
                    config, counted.tp, sequence_parallel=sp, dp_comm=counted.dp, steps=steps
                )
            results["mesh_traffic"] = {axis: counted[axis].stats.as_dict() for axis in ("tp", "dp", "pp")}
            counted.close()  # a view: closes nothing
            mesh.close()
        return results
    finally:
        meshwise.shutdown()
