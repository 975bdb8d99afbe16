"""The planner's per-call communication: the α-β fit of one collective call, the tensor-parallel calls
it counts against those a 2-rank tp / tp+sp GPT actually issues, and the measured ``cpu`` calls."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from meshwise.comm.cost.fit import fit_call_cost
from meshwise.models.gpt import CONFIGS, GPT
from meshwise.plan import Layout, ModelSpec, Precision
from meshwise.plan.calls import tensor_parallel_calls
from meshwise.plan.gloo_calls import COLLECTIVES, measure_calls
from meshwise.runtime.spawn import spawn

SIZES = (2**16, 2**20, 2**23, 2**25)


@pytest.mark.parametrize(("alpha", "beta"), [(2e-3, 1e-9), (5e-5, 1e-11), (0.0, 2.5e-9)])
def test_fit_recovers_a_synthetic_call_without_clamping(alpha: float, beta: float) -> None:
    """α and β within 5 % from times with ±2 % noise — including 100 GB/s (β = 1e-11), where the old
    two-point fit of small sizes pinned the bandwidth at its clamp and priced gradients at ~0."""
    noise = (1.02, 0.98, 1.01, 0.99)
    seconds = [(alpha + beta * n) * e for n, e in zip(SIZES, noise, strict=True)]
    if alpha + beta * SIZES[-1] < 1.5 * (alpha + beta * SIZES[0]):
        pytest.fail("the case must be identifiable")
    fitted_alpha, fitted_beta = fit_call_cost(SIZES, seconds)
    assert fitted_beta == pytest.approx(beta, rel=0.05)
    # α = 0 is matched to 5 % of the smallest call: its ±2 % noise alone is a few µs
    assert fitted_alpha == pytest.approx(alpha, rel=0.05, abs=0.05 * seconds[0] if alpha == 0 else 0)


def test_fit_refuses_a_bandwidth_it_cannot_see() -> None:
    """Sizes too small to show β: an error naming the cause, never a clamped guess."""
    with pytest.raises(ValueError, match="not identifiable"):
        fit_call_cost((1024, 4096), (1.0e-3, 1.1e-3))
    with pytest.raises(ValueError, match="at least 2"):
        fit_call_cost((1024,), (1.0e-3,))


def _issued(sp: bool, recompute: bool, batch: int) -> dict[str, dict[str, float]]:
    """On each of 2 ranks: the tp calls of one training forward + backward of a tp (or tp+sp) gpt-nano,
    counted by a counting communicator (the conversion's broadcasts left out)."""
    import meshwise
    from meshwise.comm.counting import CountingCommunicator
    from meshwise.models.gpt_plan import tensor_parallel
    from meshwise.parallel.recompute import apply_recompute
    from meshwise.parallel.tensor_parallel.vocab import vocab_parallel_cross_entropy

    world = meshwise.init(backend="gloo", timeout=60)
    try:
        config = replace(CONFIGS["gpt-nano"], seq_len=16)
        torch.manual_seed(0)
        comm = CountingCommunicator(world.comm)
        model = tensor_parallel(GPT(config), comm, sequence_parallel=sp).train()
        if recompute:
            apply_recompute(list(model.blocks), "full")
        comm.stats.reset()
        tokens = torch.randint(0, config.vocab, (batch, config.seq_len + 1))
        logits = model(tokens[:, :-1])
        vocab_parallel_cross_entropy(logits, tokens[:, 1:], comm, vocab=config.vocab).backward()
        return comm.stats.as_dict()
    finally:
        meshwise.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(("sp", "recompute"), [(False, False), (True, False), (True, True)])
def test_tensor_parallel_calls_are_the_ones_issued(sp: bool, recompute: bool) -> None:
    """Calls and bytes per collective that the planner prices for one micro-batch equal what rank 0 of
    a 2-rank gpt-nano issues in a training forward + backward (tp, tp+sp, tp+sp with full recompute)."""
    batch = 2
    issued = spawn(_issued, 2, (sp, recompute, batch), timeout=110)[0]
    config = replace(CONFIGS["gpt-nano"], seq_len=16)
    layout = Layout(1, 2, 1, micro_batch=batch, sp=sp, recompute="full" if recompute else "none")
    priced: dict[str, dict[str, float]] = {}
    for call in tensor_parallel_calls(ModelSpec.of(config), layout, Precision("fp32")):
        row = priced.setdefault(call.collective, {"calls": 0, "bytes": 0})
        row["calls"] += call.count
        row["bytes"] += call.count * call.nbytes
    calls = {op: row["calls"] for op, row in issued.items()}
    assert calls == {op: row["calls"] for op, row in priced.items()}
    for op, row in priced.items():
        assert row["bytes"] == pytest.approx(issued[op]["bytes"], rel=0.01), op


@pytest.mark.slow
def test_cpu_calls_are_measured_per_collective_and_group() -> None:
    """Four endpoints here: every collective on groups of 2 (two groups at once) and of 4, each with a
    positive latency and a bandwidth a loopback link can have (β fitted, never clamped)."""
    costs = measure_calls(4, runs=2)
    assert {(c.collective, c.group) for c in costs} == {(k, g) for k in COLLECTIVES for g in (2, 4)}
    for cost in costs:
        assert cost.alpha >= 0 and 1e6 < 1 / cost.beta < 1e12, cost
