"""The ``cpu`` preset's tensor-parallel terms: one tp rank's block priced at its own measured curve, and
the meetings of a group that calls between slices of compute (:mod:`meshwise.plan.block_time`,
:mod:`meshwise.plan.rendezvous`). Pricing is checked as arithmetic on made-up measurements; the
measuring code only for what it builds and that it returns sane numbers."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from meshwise.models.gpt import CONFIGS
from meshwise.plan import Layout, ModelSpec, Precision, block_time, hardware
from meshwise.plan.calls import tensor_parallel_calls
from meshwise.plan.hardware import GB, Efficiency, Hardware, Link, fit_efficiency, shard_curves
from meshwise.plan.rendezvous import Rendezvous, fit_rendezvous, lost_per_meeting
from meshwise.plan.step_time import block_seconds, bubble_seconds, estimate_time, step_meeting

NANO, TINY = CONFIGS["gpt-nano"], CONFIGS["gpt-tiny"]
FP32 = Precision("fp32")
PEAK = 1e10


def _cpu(**fields: object) -> Hardware:
    """A made-up measured host: the whole block at a flat half of peak, nothing else measured."""
    return Hardware(
        **{
            "name": "cpu",
            "peak_flops": {"fp32": PEAK},
            "memory": 8 * GB,
            "memory_bandwidth": 1e10,
            "intra": Link(1e9, 1e-4),
            "inter": Link(1e9, 1e-4),
            "per_node": 64,
            "efficiency": fit_efficiency({1e6: PEAK / 2, 1e9: PEAK / 2}, PEAK),
            "source": "measured",
            **fields,
        }
    )


def test_a_tp_rank_is_priced_at_its_shards_curve_and_other_degrees_at_the_whole_blocks() -> None:
    model = ModelSpec.of(NANO)
    quarter = fit_efficiency({1e6: PEAK / 4, 1e9: PEAK / 4}, PEAK)
    plain, shards = _cpu(), _cpu(shard_efficiency={(2, False): quarter})
    tp2, tp2_sp = Layout(1, 2, 1, micro_batch=4), Layout(1, 2, 1, micro_batch=4, sp=True)
    # the shard at a quarter of peak takes twice the whole block's half: twice the seconds
    assert block_seconds(model, tp2, shards, PEAK) == pytest.approx(
        2 * block_seconds(model, tp2, plain, PEAK)
    )
    # a degree (or sp) not measured, and tp 1, keep the whole block's curve
    assert block_seconds(model, tp2_sp, shards, PEAK) == block_seconds(model, tp2_sp, plain, PEAK)
    one = Layout(2, 1, 1, micro_batch=4)
    assert block_seconds(model, one, shards, PEAK) == block_seconds(model, one, plain, PEAK)
    # the whole block: FLOPs per token (recomputation counted) over the rate, ÷ t
    expected = model.flops_per_token() * 4 * NANO.seq_len / 2 / (PEAK / 2)
    assert block_seconds(model, tp2, plain, PEAK) == pytest.approx(expected)


def test_fit_rendezvous_is_the_line_through_its_ends_never_below_zero() -> None:
    cost = fit_rendezvous({0.002: 0.001, 0.020: 0.004})
    assert cost.drift == pytest.approx(0.003 / 0.018)
    assert cost.alpha == pytest.approx(0.001 - 0.002 * 0.003 / 0.018)
    assert cost.seconds(10, 0.5) == pytest.approx(10 * cost.alpha + 0.5 * cost.drift)
    # a longer slice losing less is noise: no drift, the shorter slice's loss per meeting
    assert fit_rendezvous({0.002: 0.003, 0.020: 0.001}) == Rendezvous(0.003, 0.0)
    # a steep line through zero's far side: no negative meeting cost
    assert fit_rendezvous({0.002: 0.0, 0.020: 0.01}).alpha == 0.0


def test_every_tp_call_is_a_meeting_and_the_group_drifts_over_its_compute() -> None:
    """The tp term grows by α per call the group makes plus drift × the micro-batch's compute (blocks
    and head); m micro-batches pay it m times; a layout without tp pays nothing."""
    model, layout, batch = ModelSpec.of(NANO), Layout(1, 2, 1, micro_batch=2), 8
    meeting = Rendezvous(alpha=1e-3, drift=0.1)
    plain, met = _cpu(), _cpu(rendezvous={2: meeting})
    before, after = (estimate_time(model, layout, hw, FP32, batch) for hw in (plain, met))
    m = layout.micro_batches(batch)
    syncs = sum(call.count for call in tensor_parallel_calls(model, layout, FP32))
    added = m * meeting.seconds(syncs, before.compute / m)
    assert after.tensor_parallel - before.tensor_parallel == pytest.approx(added)
    assert after.compute == before.compute
    assert after.sync == before.sync  # the tp group is every rank: no meeting of all once more
    dp = Layout(2, 1, 1, micro_batch=2)
    assert estimate_time(model, dp, met, FP32, batch).tensor_parallel == 0.0


def test_context_parallel_gathers_meet_too() -> None:
    model, layout = ModelSpec.of(NANO), Layout(1, 1, 1, micro_batch=4, cp=2)
    meeting = Rendezvous(alpha=1e-3, drift=0.0)
    before = estimate_time(model, layout, _cpu(), FP32, 8)
    after = estimate_time(model, layout, _cpu(rendezvous={2: meeting}), FP32, 8)
    # per layer two gathers and a reduce-scatter, per micro-batch (m = 2)
    assert after.context_parallel - before.context_parallel == pytest.approx(2 * NANO.layers * 3 * 1e-3)


def test_gpu_presets_measure_neither_and_price_as_before() -> None:
    hw = hardware("a100-80gb")
    assert hw.shard_efficiency == {} and hw.rendezvous == {}
    assert hw.block_efficiency(8, True) is hw.efficiency and hw.meetings(8, 100, 1.0) == 0.0
    model, layout = ModelSpec.from_parameters(7e9), Layout(8, 8, 1, micro_batch=1)
    c = model.config
    gemm = 2 * c.seq_len * c.hidden * 4 * c.hidden / 8
    expected = model.flops_per_token() * c.seq_len / 8 / (hw.peak("bf16") * hw.efficiency.at(gemm))
    assert block_seconds(model, layout, hw, hw.peak("bf16")) == pytest.approx(expected)


def test_shard_curves_cover_the_degrees_the_ranks_and_heads_allow(monkeypatch) -> None:
    seen = []

    def fake(config, tp, sp, whole):
        seen.append((tp, sp))
        return {key: rate / tp for key, rate in whole.items()}

    monkeypatch.setattr(block_time, "shard_rates", fake)
    six_heads, whole = replace(TINY, heads=6, hidden=96), {1e6: PEAK}
    assert set(shard_curves(six_heads, 4, PEAK, whole)) == {(2, False), (2, True)}  # 4 ∤ 6 heads
    assert set(shard_curves(TINY, 4, PEAK, whole)) == {(2, False), (2, True), (4, False), (4, True)}
    assert shard_curves(TINY, 1, PEAK, whole) == {}
    assert shard_curves(CONFIGS["gpt-moe-tiny"], 2, PEAK, whole) == {}  # experts stay whole under tp
    assert shard_curves(TINY, 2, PEAK, whole)[2, True] == Efficiency(best=0.5, table=((1e6, 0.5),))
    assert len(seen) == 2 + 4 + 2


def test_a_shard_block_has_the_shards_shapes_and_runs_forward_and_backward() -> None:
    h, s = TINY.hidden, TINY.seq_len
    block = block_time.shard_block(TINY, 2, False)
    assert block.attn.q.weight.shape == (h // 2, h) and block.mlp.fc.weight.shape == (4 * h // 2, h)
    assert block.attn.out.weight.shape == (h, h // 2) and block.ln1.weight.shape == (h,)
    x = torch.randn(2, s, h, requires_grad=True)
    block(x).sum().backward()
    assert x.grad.shape == x.shape
    sp = block_time.shard_block(TINY, 2, True)
    y = torch.randn(2, s // 2, h, requires_grad=True)  # the sequence shard in, the shard out
    out = sp(y)
    assert out.shape == y.shape
    out.sum().backward()
    assert all(p.grad is not None for p in sp.parameters())


def test_lost_per_meeting_times_a_slice_and_a_non_negative_loss() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        slice_seconds, lost = lost_per_meeting(2, 2, 64, rounds=4)
    finally:
        torch.set_num_threads(before)
    assert slice_seconds > 0 and lost >= 0


def test_the_bubble_shrinks_where_idle_stages_give_their_cores_to_busy_ones() -> None:
    # each rank its device: the busy time stretched by 1/(1 - idle)
    assert bubble_seconds(1.0, 1 / 3) == pytest.approx(0.5)
    # 4 ranks at half speed each while all compute: alone they run 2x faster, 1.5 x 0.5 < 1, no bubble
    assert bubble_seconds(1.0, 1 / 3, share=0.5) == 0.0
    # in between: the critical path at the alone speed beyond the busy time
    assert bubble_seconds(1.0, 1 / 3, share=0.8) == pytest.approx(0.8 * 1.5 - 1.0)
    model, four, two = ModelSpec.of(NANO), Layout(2, 1, 2, micro_batch=2), Layout(1, 1, 2, micro_batch=2)
    host = _cpu(share=0.5, cores=2, threads=1)
    assert estimate_time(model, four, host, FP32, 8).bubble == 0.0  # 4 ranks on 2 cores
    # 2 one-thread ranks on 2 cores: a stage's idle core is of no use to the other, whatever the share
    alone = estimate_time(model, two, replace(host, share=1.0), FP32, 8)
    assert estimate_time(model, two, host, FP32, 8).bubble == alone.bubble > 0


def test_shard_rates_are_the_whole_blocks_scaled_by_the_paired_ratio(monkeypatch) -> None:
    """Each shard point keeps the whole block's key and scales its rate by whole time / shard time."""
    monkeypatch.setattr(block_time, "paired_times", lambda first, second: (0.02, 0.01))
    s, h = TINY.seq_len, TINY.hidden
    whole = {2.0 * b * s * h * 4 * h: 1e9 * b for b in (1, 2, 16)}
    expected = {key: 2 * rate for key, rate in whole.items() if key < 2.0 * 16 * s * h * 4 * h}
    assert block_time.shard_rates(TINY, 2, True, whole) == expected  # 16 is not paired


def test_every_rank_meets_once_a_step_after_its_compute() -> None:
    model, batch, meeting = ModelSpec.of(NANO), 8, Rendezvous(alpha=1e-3, drift=0.1)
    plain, met = _cpu(), _cpu(rendezvous={4: meeting, 2: meeting})
    dp4 = Layout(4, 1, 1, micro_batch=2)
    before, after = (estimate_time(model, dp4, hw, FP32, batch) for hw in (plain, met))
    assert after.sync - before.sync == pytest.approx(1e-3 + 0.1 * (before.compute + before.head))
    assert step_meeting(dp4, plain, 1.0) == 0.0  # nothing measured (GPU presets)
    assert step_meeting(Layout(1, 4, 1), met, 1.0) == 0.0  # tp over every rank meets per layer already
    assert step_meeting(Layout(2, 2, 1), met, 1.0) == pytest.approx(1e-3 + 0.1)
