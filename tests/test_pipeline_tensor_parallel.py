"""pp × tp, and pp × tp × dp, against one process: every stage tensor parallel (± SP) inside its tp group.

One spawn of 4 ranks (pp = 2 × tp = 2) runs several schedules; each rank also trains the whole model on
the whole batch from the same weights (the reference) and compares the loss, every gradient and every
weight after SGD steps, shards reassembled into full tensors over the tp group. The vocabulary (63) does
not divide by tp, so the padded vocabulary shards of the embedding and of the last stage's own head copy
are exercised too.
"""

from __future__ import annotations

import copy
from functools import partial

import torch

import meshwise
from meshwise.comm.api import ReduceOp
from meshwise.comm.mesh import Mesh, MeshShape
from meshwise.models.gpt import GPT, GPTConfig, language_model_loss
from meshwise.models.gpt_plan import gpt_plan, tensor_parallel
from meshwise.parallel.pipeline_parallel import chunk_parameters
from meshwise.parallel.pipeline_parallel.builder import build_pipeline, micro_batches_of
from meshwise.parallel.tensor_parallel import full_tensors, shard_dim, vocab_parallel_cross_entropy
from meshwise.runtime.spawn import spawn

CONFIG = GPTConfig(layers=4, hidden=32, heads=4, seq_len=16, vocab=63)
STEPS = 3
MICRO = 2  # sequences per micro-batch
TOLERANCE = 2e-5


def _batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(0, CONFIG.vocab, (size, CONFIG.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _worst(chunks, tp, reference: dict[str, torch.Tensor], *, grads: bool) -> float:
    """Largest |full tensor − reference| over this rank's chunks (collective over ``tp``)."""
    worst = 0.0
    for chunk in chunks:
        for name, full in full_tensors(chunk, tp, grads=grads).items():
            ref = reference["wte.weight" if name == "head.weight" else name]
            ref = ref.grad if grads else ref
            worst = max(worst, (full.narrow(0, 0, ref.shape[0]) - ref).abs().max().item())
    return worst


def _compare(mesh: Mesh, schedule: str, m: int, v: int, sp: bool) -> dict[str, float]:
    """The reference trains on the whole batch; each dp replica of the pipeline on its slice of it."""
    torch.manual_seed(0)
    reference = GPT(CONFIG)
    dp_size, dp_rank = mesh.shape.dp, mesh.coordinates["dp"]
    stage_model = tensor_parallel(copy.deepcopy(reference), mesh.tp, sequence_parallel=sp)
    loss = partial(vocab_parallel_cross_entropy, comm=mesh.tp, vocab=CONFIG.vocab)
    executor, chunks = build_pipeline(
        stage_model, gpt_plan(CONFIG), mesh.pp, schedule=schedule, micro_batches=m, virtual_stages=v,
        dp=mesh.dp if dp_size > 1 else None, loss=loss, sequence_shards=mesh.tp.world_size if sp else 1,
        in_place=True,
    )  # fmt: skip
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    opt = torch.optim.SGD(chunk_parameters(chunks), lr=0.5)
    worst = {"loss": 0.0, "grad": 0.0, "weight": 0.0}
    sharded = sum(shard_dim(p) is not None for p in chunk_parameters(chunks))
    for step in range(STEPS):
        x, y = _batch(step, MICRO * m * dp_size)
        ref_opt.zero_grad()
        ref_loss = language_model_loss(reference(x), y)
        ref_loss.backward()
        opt.zero_grad()
        mine = slice(dp_rank * MICRO * m, (dp_rank + 1) * MICRO * m)
        result = executor.step(micro_batches_of(x[mine], m), micro_batches_of(y[mine], m))
        loss = torch.tensor([result.loss], dtype=torch.float64)
        if dp_size > 1:  # the executor returns its replica's loss; the batch's is their mean
            mesh.dp.all_reduce(loss, ReduceOp.AVG)
        worst["loss"] = max(worst["loss"], abs(loss.item() - ref_loss.item()))
        worst["grad"] = max(worst["grad"], _worst(chunks, mesh.tp, ref_params, grads=True))
        ref_opt.step()
        opt.step()
        worst["weight"] = max(worst["weight"], _worst(chunks, mesh.tp, ref_params, grads=False))
    x, y = _batch(STEPS, 2)
    with torch.no_grad():
        expected = language_model_loss(reference(x), y).item()
    loss = partial(vocab_parallel_cross_entropy, comm=mesh.tp, vocab=CONFIG.vocab)
    worst["eval"] = abs(executor.forward_only(x, y, loss) - expected)
    executor.close()
    return worst | {"sharded": sharded}


def _run() -> dict[str, dict[str, float]]:
    w = meshwise.init(backend="gloo", timeout=60)
    try:
        mesh = Mesh(w.comm, MeshShape(tp=2, pp=2))
        configs = [("1f1b", 4, 1, False), ("1f1b", 4, 1, True), ("gpipe", 2, 1, True), ("zb", 4, 1, False)]
        configs.append(("interleaved", 2, 2, True))
        return {f"{s}-m{m}-v{v}{'-sp' if sp else ''}": _compare(mesh, s, m, v, sp) for s, m, v, sp in configs}
    finally:
        meshwise.shutdown()


def _run_3d() -> dict[str, dict[str, float]]:
    w = meshwise.init(backend="gloo", timeout=60)
    try:
        mesh = Mesh(w.comm, MeshShape(dp=2, tp=2, pp=2))
        return {"dp2-tp2-pp2-1f1b-m2-sp": _compare(mesh, "1f1b", 2, 1, True)}
    finally:
        meshwise.shutdown()


def _check(results: list[dict[str, dict[str, float]]]) -> None:
    for rank, per_rank in enumerate(results):
        for name, worst in per_rank.items():
            assert worst.pop("sharded") >= 8, (rank, name)  # 2 blocks × q, k, v, out, fc, proj + vocab
            for key, value in worst.items():
                assert value < TOLERANCE, (rank, name, key, worst)


def test_pipeline_times_tensor_parallel_matches_one_process() -> None:
    _check(spawn(_run, 4, timeout=110))


def test_pipeline_tensor_and_data_parallel_together_match_one_process() -> None:
    """All three axes at once on 8 ranks (4 per core here, so one small configuration): gradients
    averaged over dp after the pipeline, activations and SP shards between matching tp ranks of the
    stages; without the dp average the gradients differ from the reference by 0.06."""
    _check(spawn(_run_3d, 8, timeout=110))
