"""Pipeline parallel against one process: loss and every gradient equal, step by step, for every schedule.

One spawn per world size runs every schedule (and, on 4 ranks, pp = 2 × dp = 2; on 3 ranks, a stage
that raises) and returns the worst differences, so a failure names the configuration. Each rank also
trains the whole model itself on the whole batch from the same weights: that is the reference.
"""

from __future__ import annotations

import time

import pytest
import torch

import meshwise
from meshwise.comm.api import ReduceOp
from meshwise.comm.mesh import Mesh, MeshShape
from meshwise.models.gpt import GPT, GPTConfig, language_model_loss
from meshwise.models.gpt_plan import gpt_plan
from meshwise.parallel.pipeline_parallel import PipelineFailure, chunk_parameters
from meshwise.parallel.pipeline_parallel.builder import build_pipeline, micro_batches_of
from meshwise.runtime.spawn import spawn

CONFIG = GPTConfig(layers=8, hidden=32, heads=4, seq_len=16, vocab=64)
STEPS = 3
MICRO = 2  # sequences per micro-batch
TOLERANCE = 2e-5


def _batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, CONFIG.vocab, (size, CONFIG.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _reference() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def _compare(pp, dp, schedule: str, m: int, v: int, dp_size: int = 1, dp_rank: int = 0) -> dict[str, float]:
    """Worst |loss − ref| and |grad − ref| over STEPS steps of SGD, and whether the weights stayed equal."""
    reference = _reference()
    executor, chunks = build_pipeline(
        reference, gpt_plan(CONFIG), pp, schedule=schedule, micro_batches=m, virtual_stages=v, dp=dp
    )
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    opt = torch.optim.SGD(chunk_parameters(chunks), lr=0.5)
    worst = {"loss": 0.0, "grad": 0.0, "weight": 0.0, "peak_bytes": 0.0}
    for step in range(STEPS):
        x, y = _batch(step, MICRO * m * dp_size)
        ref_opt.zero_grad()
        ref_loss = language_model_loss(reference(x), y)
        ref_loss.backward()
        opt.zero_grad()
        mine = slice(dp_rank * MICRO * m, (dp_rank + 1) * MICRO * m)
        result = executor.step(micro_batches_of(x[mine], m), micro_batches_of(y[mine], m))
        loss = torch.tensor([result.loss], dtype=torch.float64)
        if dp is not None:  # the executor returns its replica's loss; the batch's is their mean
            dp.all_reduce(loss, ReduceOp.AVG)
        worst["loss"] = max(worst["loss"], abs(loss.item() - ref_loss.item()))
        worst["peak_bytes"] = max(worst["peak_bytes"], result.peak_activation_bytes)
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                ref = ref_params["wte.weight" if name == "head.weight" else name]
                worst["grad"] = max(worst["grad"], (param.grad - ref.grad).abs().max().item())
        ref_opt.step()
        opt.step()
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                ref = ref_params["wte.weight" if name == "head.weight" else name]
                worst["weight"] = max(worst["weight"], (param - ref).abs().max().item())
    x, y = _batch(STEPS, 3)  # evaluation: one batch of another size through every stage, no backward
    with torch.no_grad():
        expected = language_model_loss(reference(x), y).item()
    worst["eval"] = abs(executor.forward_only(x, y, language_model_loss) - expected)
    executor.close()
    return worst


def _configs(p: int) -> list[tuple[str, int, int]]:
    return [("gpipe", 2 * p, 1), ("1f1b", 2 * p, 1), ("1f1b", 1, 1), ("zb", 2 * p, 1), ("interleaved", p, 2)]


def _failure(comm) -> dict[str, object]:
    """Stage 1 raises on micro-batch 2: every rank must raise PipelineFailure naming it, quickly."""
    executor, chunks = build_pipeline(_reference(), gpt_plan(CONFIG), comm, schedule="1f1b", micro_batches=4)
    if comm.rank == 1:
        original = chunks[0].forward
        calls = {"n": 0}

        def broken(x: torch.Tensor) -> torch.Tensor:
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected fault")
            return original(x)

        chunks[0].forward = broken  # type: ignore[method-assign]
    x, y = _batch(0, MICRO * 4)
    start = time.monotonic()
    try:
        executor.step(micro_batches_of(x, 4), micro_batches_of(y, 4))
    except PipelineFailure as failure:
        return {
            "message": str(failure),
            "seconds": time.monotonic() - start,
            "stage": failure.stage,
            "micro_batch": failure.micro_batch,
        }
    return {"message": "no failure", "seconds": time.monotonic() - start}


def _bad_batch(comm, who: int, what: str) -> dict[str, object]:
    """Rank ``who`` passes a bad batch on the first step: every rank must stop with the reason."""
    executor, _ = build_pipeline(_reference(), gpt_plan(CONFIG), comm, schedule="1f1b", micro_batches=4)
    x, y = (micro_batches_of(t, 4) for t in _batch(0, MICRO * 4))
    if comm.rank == who:
        x, y = (None, y) if what == "inputs" else (x, y[:3])
    try:
        executor.step(x, y)
    except PipelineFailure as failure:
        return {"message": str(failure), "stage": failure.stage}
    return {"message": "no failure", "stage": None}


def _run(world: int) -> dict[str, object]:
    w = meshwise.init(backend="gloo", timeout=60)
    try:
        out: dict[str, object] = {}
        for schedule, m, v in _configs(world):
            out[f"pp{world}-{schedule}-m{m}-v{v}"] = _compare(w.comm, None, schedule, m, v)
        if world == 2:  # one-rank pipelines: chunks hand over locally, the head shares the embedding
            solos = [w.comm.split([r]) for r in range(world)]
            out["pp1-interleaved-m2-v2"] = _compare(solos[w.rank], None, "interleaved", 2, 2)
            out["pp1-zb-m3-v1"] = _compare(solos[w.rank], None, "zb", 3, 1)
        if world == 4:
            mesh = Mesh(w.comm, MeshShape(dp=2, pp=2))
            for schedule, v in (("1f1b", 1), ("zb", 1), ("interleaved", 2)):  # each chunk's own reducer
                out[f"pp2xdp2-{schedule}"] = _compare(
                    mesh.pp, mesh.dp, schedule, 4, v, dp_size=2, dp_rank=mesh.coordinates["dp"]
                )
        # one failure per spawn, last: afterwards the pairs may hold messages nobody received
        if world == 2:
            out["bad-targets"] = _bad_batch(w.comm, 1, "targets")
        elif world == 3:
            out["failure"] = _failure(w.comm)
        else:
            out["bad-inputs"] = _bad_batch(w.comm, 0, "inputs")
        return out
    finally:
        meshwise.shutdown()


def _replica_failure() -> dict[str, object]:
    """pp 2 × dp 2 with the reducer: stage 1 of replica 1 raises on micro-batch 2 (its last micro-batch
    is 3: the failing rank has launched none of its buckets, its healthy dp peer all of them). Every rank
    of both replicas must raise PipelineFailure naming it, quickly — no collective left unpaired."""
    w = meshwise.init(backend="gloo", timeout=30)
    try:
        mesh = Mesh(w.comm, MeshShape(dp=2, pp=2))
        executor, chunks = build_pipeline(
            _reference(), gpt_plan(CONFIG), mesh.pp, schedule="1f1b", micro_batches=4, dp=mesh.dp
        )
        if mesh.coordinates == {**mesh.coordinates, "pp": 1, "dp": 1}:
            original, calls = chunks[0].forward, {"n": 0}

            def broken(x: torch.Tensor) -> torch.Tensor:
                calls["n"] += 1
                if calls["n"] == 3:
                    raise RuntimeError("injected fault")
                return original(x)

            chunks[0].forward = broken  # type: ignore[method-assign]
        x, y = _batch(0, MICRO * 4)
        start = time.monotonic()
        try:
            executor.step(micro_batches_of(x, 4), micro_batches_of(y, 4))
        except PipelineFailure as failure:
            return {
                "stage": failure.stage,
                "micro_batch": failure.micro_batch,
                "seconds": time.monotonic() - start,
            }
        return {"stage": None, "seconds": time.monotonic() - start}
    finally:
        meshwise.shutdown()


def test_a_failing_replica_stops_every_replica() -> None:
    for result in spawn(_replica_failure, 4, timeout=90):
        assert result["stage"] == 1 and result["micro_batch"] == 2, result
        assert result["seconds"] < 10, result


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pipeline_matches_one_process(world: int) -> None:
    results = spawn(_run, world, args=(world,), timeout=110)
    for rank, per_rank in enumerate(results):
        gpipe, one_f = (
            per_rank[f"pp{world}-gpipe-m{2 * world}-v1"],
            per_rank[f"pp{world}-1f1b-m{2 * world}-v1"],
        )
        # GPipe holds all m = 2p micro-batches' activations; 1F1B at most p − rank
        assert one_f["peak_bytes"] * 2 * world == gpipe["peak_bytes"] * (world - rank), (rank, one_f, gpipe)
        for name, worst in per_rank.items():
            if name.startswith("bad-"):
                assert worst["stage"] == (world - 1 if name == "bad-targets" else 0), (rank, worst)
                if rank == worst["stage"]:
                    assert ("needs 4 micro-batch targets, got 3" in worst["message"]) or (
                        "needs 4 micro-batch inputs, got none" in worst["message"]
                    ), worst
                continue
            if name == "failure":
                assert worst["stage"] == 1 and worst["micro_batch"] == 2, (rank, worst)
                assert "stage 1 (chunk 1) failed on micro-batch 2" in worst["message"], worst
                assert worst["seconds"] < 10, worst
                continue
            assert worst["loss"] < TOLERANCE, (rank, name, worst)
            assert worst["grad"] < TOLERANCE, (rank, name, worst)
            assert worst["weight"] < TOLERANCE, (rank, name, worst)
            assert worst["eval"] < TOLERANCE, (rank, name, worst)
