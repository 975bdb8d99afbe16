"""Rank-side checks for the expert-parallel tests: each returns plain numbers the test asserts on.

Every check builds the one-process reference in the same rank from the same seed. ep ranks are carved from
the data ranks, so rank r trains on shard r of the batch; the reference runs the same shards one after the
other as accumulated micro-batches (a capacity applies per forward pass, so this is the one-process model
that drops the same tokens) and its gradient is their mean.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, replace

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import meshwise
from meshwise.comm.api import Communicator, ReduceOp
from meshwise.models.gpt import GPT, GPTConfig, language_model_loss
from meshwise.models.moe import combine, group_by_expert, moe_layers, route, with_auxiliary_losses
from meshwise.parallel import DataParallel
from meshwise.parallel.expert_parallel import (
    AllToAllExchange,
    ExpertReplicas,
    apply_expert_parallel,
    is_expert_parameter,
    local_experts,
    moe_report,
)
from meshwise.parallel.optimizer_state import init_optimizer_state

CONFIG = GPTConfig(layers=2, hidden=32, heads=4, seq_len=8, vocab=64, experts=4, top_k=2)
PER_RANK = 2  # sequences per data rank per step


def identity_round_trip(comm: Communicator, experts: int = 8, top_k: int = 2, tokens: int = 12) -> dict:
    """combine(dispatch(x)) through identity experts on the ranks of ``comm`` is x·Σ(kept probabilities),
    and its gradients with respect to x and the router logits are those of x·Σ(kept probabilities)
    computed without any exchange. Returns the largest errors and the assignments dropped."""
    generator = torch.Generator().manual_seed(10 + comm.rank)  # every rank routes differently
    x = torch.randn(tokens, 16, generator=generator, requires_grad=True)
    logits = torch.randn(tokens, experts, generator=generator, requires_grad=True)
    upstream = torch.randn(tokens, 16, generator=generator)
    errors = {}
    for label, capacity in (("dropless", None), ("capacity", 0.5)):
        routing = route(logits, top_k, capacity)
        grouped, counts, order = group_by_expert(x, routing)
        exchange = AllToAllExchange(comm, experts)
        mixed = combine(exchange(grouped, counts, lambda rows, _: rows), order, routing, tokens)
        x.grad = logits.grad = None
        (mixed * upstream).sum().backward()
        dx, dlogits = x.grad.clone(), logits.grad.clone()
        routing = route(logits, top_k, capacity)
        expected = x * (routing.weights * routing.kept).sum(dim=1, keepdim=True)
        x.grad = logits.grad = None
        (expected * upstream).sum().backward()
        errors[label] = {
            "value": (mixed - expected).abs().max().item(),
            "dx": (dx - x.grad).abs().max().item(),
            "dlogits": (dlogits - logits.grad).abs().max().item(),
            "dropped": int((~routing.kept).sum()),
        }
    return errors


def _expert_data_parallel(
    model: torch.nn.Module, data_comm: Communicator, expert_data_comm: Communicator | None, ep: int
) -> DataParallel:
    """``model`` (its experts cut over ep) with dense gradients averaged over ``data_comm`` and expert ones
    over ``expert_data_comm`` (None: each expert lives on one rank, a group of one)."""
    experts = expert_data_comm if expert_data_comm is not None else data_comm.split([data_comm.rank])
    assert experts is not None
    return DataParallel(model, data_comm, experts=ExpertReplicas(experts, ep))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _report(model: torch.nn.Module, comm: Communicator | None) -> dict:
    report = moe_report(model, comm)
    assert report is not None
    return asdict(report)


def gpt_parity(
    config: GPTConfig,
    ep_comm: Communicator,
    data_comm: Communicator,
    expert_data_comm: Communicator | None = None,
    steps: int = 2,
) -> dict:
    """Max |ep − reference| over ``steps`` AdamW steps of loss, every gradient, every weight, and the
    router report (token counts must be equal; auxiliary losses within rounding)."""
    torch.manual_seed(0)
    reference = GPT(config)
    model = apply_expert_parallel(copy.deepcopy(reference), ep_comm)
    # eps=1e-6: Adam divides by the gradient's own magnitude, so rounding-level gradient differences near
    # eps=1e-8 would become weight differences of up to lr (see tests/tp_checks.py)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    wrapped = _expert_data_parallel(model, data_comm, expert_data_comm, ep_comm.world_size)
    data = torch.Generator().manual_seed(1)
    shards = data_comm.world_size
    diffs = {"loss": 0.0, "grads": 0.0, "weights": 0.0, "aux": 0.0, "counts_equal": True}
    for _ in range(steps):
        tokens = torch.randint(0, config.vocab, (shards * PER_RANK, config.seq_len + 1), generator=data)
        ref_opt.zero_grad()
        ref_loss = 0.0
        for shard in tokens.chunk(shards):
            lm_loss = language_model_loss(reference(shard[:, :-1]), shard[:, 1:])
            loss = with_auxiliary_losses(lm_loss, reference)
            (loss / shards).backward()
            ref_loss += loss.item() / shards
        mine = tokens.chunk(shards)[data_comm.rank]
        opt.zero_grad()
        loss = with_auxiliary_losses(language_model_loss(wrapped(mine[:, :-1]), mine[:, 1:]), model)
        loss.backward()  # the reducers average as it ends
        mean_loss = torch.tensor([loss.item()], dtype=torch.float64)
        data_comm.all_reduce(mean_loss, ReduceOp.AVG)
        ref_grads, grads = _grads(reference), _grads(model)
        assert set(grads) <= set(ref_grads), sorted(set(grads) - set(ref_grads))
        assert {n for n in ref_grads if not is_expert_parameter(n)} <= set(grads)
        ref_report, report = _report(reference, None), _report(model, data_comm)
        diffs["loss"] = max(diffs["loss"], abs(mean_loss.item() - ref_loss))
        diffs["grads"] = max(diffs["grads"], max((grads[n] - ref_grads[n]).abs().max().item() for n in grads))
        for key in ("balance_loss", "z_loss"):
            diffs["aux"] = max(diffs["aux"], abs(report[key] - ref_report[key]))
        counts = ("tokens_min", "tokens_max", "tokens_mean", "dropped", "assignments")
        diffs["counts_equal"] &= all(report[k] == ref_report[k] for k in counts)
        ref_opt.step()
        opt.step()
    ref_params = dict(reference.named_parameters())
    diffs["weights"] = max((p - ref_params[n]).abs().max().item() for n, p in model.named_parameters())
    names = [n for n, _ in model.named_parameters() if is_expert_parameter(n)]
    diffs["experts_held"] = sorted({n.split(".experts.")[1].split(".")[0] for n in names})
    diffs["experts_expected"] = sorted(
        str(e) for e in local_experts(config.experts, ep_comm.world_size, ep_comm.rank)
    )
    return diffs


def skewed_router(ep_comm: Communicator, capacity_factor: float | None) -> dict:
    """Every token routed to expert 0 (a hook adds 100 to its router logit): forward and backward run,
    and the report shows the imbalance and, with a capacity, the drops."""
    config = replace(CONFIG, top_k=1, capacity_factor=capacity_factor)
    torch.manual_seed(0)
    model = apply_expert_parallel(GPT(config), ep_comm)
    wrapped = _expert_data_parallel(model, ep_comm, None, ep_comm.world_size)
    bias = torch.zeros(config.experts)
    bias[0] = 100.0
    for layer in moe_layers(model):
        layer.router.register_forward_hook(lambda _module, _inputs, logits: logits + bias)
    tokens = torch.randint(0, config.vocab, (PER_RANK, config.seq_len + 1), generator=torch.Generator())
    loss = with_auxiliary_losses(language_model_loss(wrapped(tokens[:, :-1]), tokens[:, 1:]), model)
    loss.backward()
    # experts that got no token still run on an empty slice, so every parameter has a (zero) gradient and
    # data parallelism's reducer sees no unused parameter
    every = all(p.grad is not None for p in model.parameters())
    finite = every and all(torch.isfinite(p.grad).all() for p in model.parameters())
    return {"finite": bool(finite and torch.isfinite(loss)), "report": _report(model, ep_comm)}


def run_checks(backend: str, ep: int) -> dict:
    """All checks on one spawned world: ep over the whole world, or (ep < world) ep groups of ``ep``
    consecutive ranks whose experts are replicated across the groups (ep·dp)."""
    world = meshwise.init(backend=backend, timeout=60)  # a mismatch fails in 60 s, naming rank and op
    try:
        comm, n = world.comm, world.world_size
        results: dict = {"round_trip": identity_round_trip(comm)}
        if ep == n:
            for capacity in (None, 1.0):
                config = replace(CONFIG, capacity_factor=capacity)
                results[f"gpt:cf={capacity}"] = gpt_parity(config, comm, comm)
            results["skewed"] = {cf: skewed_router(comm, cf) for cf in (None, 1.0)}
            return results
        groups = [comm.split(list(range(g, g + ep))) for g in range(0, n, ep)]
        replicas = [comm.split(list(range(r, n, ep))) for r in range(ep)]
        ep_comm = next(g for g in groups if g is not None)
        expert_data = next(r for r in replicas if r is not None)
        results["gpt:ep·dp"] = gpt_parity(replace(CONFIG, capacity_factor=1.0), ep_comm, comm, expert_data)
        return results
    finally:
        meshwise.shutdown()


def _trained_state(model: torch.nn.Module, comm: Communicator, replicated: bool) -> dict:
    """One AdamW step of ``model`` on this rank's shard (gradients reduced: experts over every rank when
    each holds all of them), then its DCP state by name."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab, (comm.world_size * PER_RANK, CONFIG.seq_len + 1), generator=data)
    mine = tokens.chunk(comm.world_size)[comm.rank]
    wrapped = (
        DataParallel(model, comm) if replicated else _expert_data_parallel(model, comm, None, comm.world_size)
    )
    with_auxiliary_losses(language_model_loss(wrapped(mine[:, :-1]), mine[:, 1:]), model).backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "optimizer": optimizer}


def _restored(model: torch.nn.Module, path: str) -> dict:
    """``model`` and a fresh AdamW filled from the DCP checkpoint at ``path``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    init_optimizer_state(optimizer)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return dict(zip(("model", "optim"), get_state_dict(model, optimizer), strict=True))


def _largest_difference(saved: dict, restored: dict) -> float:
    """Max |saved − restored| over the names both hold: weights, and Adam's moments and step per name."""
    worst = max((saved["model"][k] - restored["model"][k]).abs().max().item() for k in saved["model"]
                if k in restored["model"])  # fmt: skip
    moments = restored["optim"]["state"]
    for name, slots in saved["optim"]["state"].items():
        if name in moments:
            worst = max(worst, *((slots[s] - moments[name][s]).abs().max().item() for s in slots))
    return worst


def checkpoint_across_ep(directory: str) -> dict:
    """A DCP checkpoint written by ep2 loads into the whole model on each rank (one process's layout), and
    one written by the whole model loads into ep2: weights and AdamW state equal by name, exactly."""
    world = meshwise.init(backend="gloo", timeout=60)
    try:
        comm = world.comm
        results = {}
        for saved_by, loaded_by in (("ep2", "whole"), ("whole", "ep2")):
            torch.manual_seed(0)
            models = {"whole": GPT(CONFIG)}
            models["ep2"] = apply_expert_parallel(copy.deepcopy(models["whole"]), comm)
            saved = _trained_state(models[saved_by], comm, replicated=saved_by == "whole")
            path = f"{directory}/{saved_by}"
            dcp.save({"model": saved["model"], "optim": saved["optim"]}, checkpoint_id=path)
            comm.barrier()
            torch.manual_seed(1)  # other initial weights: only the checkpoint can make them equal
            fresh = GPT(CONFIG) if loaded_by == "whole" else apply_expert_parallel(GPT(CONFIG), comm)
            restored = _restored(fresh, path)
            # each rank checks the names it saved; the whole models must then also agree across ranks
            flat = torch.cat([t.reshape(-1) for t in restored["model"].values()])
            first = flat.clone()
            comm.broadcast(first, 0)
            results[f"{saved_by}->{loaded_by}"] = {
                "difference": _largest_difference(saved, restored),
                "names compared": len(set(saved["model"]) & set(restored["model"])),
                "names held": len(restored["model"]),
                "ranks differ by": (flat - first).abs().max().item() if loaded_by == "whole" else 0.0,
            }
        return results
    finally:
        meshwise.shutdown()
