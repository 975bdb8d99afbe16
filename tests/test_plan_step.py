"""The step-time terms outside the blocks (the head and loss, clipping as trained, the step's scalar
all-reduces) and context parallelism's memory buffers: arithmetic against the formulas they stand for,
no processes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from meshwise.models.gpt import CONFIGS
from meshwise.plan import Layout, ModelSpec, Precision, hardware
from meshwise.plan.gloo_calls import CallCost
from meshwise.plan.hardware import GB, Hardware, Link, clip_as_trained, fit_efficiency
from meshwise.plan.head_time import HeadCost, fit_head, head_cost
from meshwise.plan.memory import context_parallel_buffers, estimate_memory
from meshwise.plan.step_time import estimate_time, sync_seconds

NANO = CONFIGS["gpt-nano"]
FP32 = Precision("fp32")


def _cpu(head: HeadCost | None = None, calls: tuple[CallCost, ...] = ()) -> Hardware:
    """A made-up measured host: a flat 10 GFLOP/s efficiency table, optionally a head and call costs."""
    return Hardware(
        name="cpu",
        peak_flops={"fp32": 1e10},
        memory=8 * GB,
        memory_bandwidth=1e10,
        intra=Link(1e9, 1e-4),
        inter=Link(1e9, 1e-4),
        per_node=64,
        efficiency=fit_efficiency({1e6: 1e10, 1e9: 1e10}, 1e10),
        collective_copies=True,
        head=head,
        calls=calls,
        source="measured",
    )


def test_fit_head_is_the_line_through_its_ends_and_never_negative() -> None:
    cost = fit_head({64: 0.003, 256: 0.006})
    assert cost.per_token == pytest.approx(0.003 / 192) and cost.alpha == pytest.approx(0.002)
    assert cost.seconds(128) == pytest.approx(0.002 + 128 * 0.003 / 192)
    # noise larger than the difference: proportional to the larger measurement, no negative slope
    assert fit_head({64: 0.004, 256: 0.003}) == HeadCost(0.0, 0.003 / 256)
    # a line through the origin's far side would price small micro-batches below zero
    assert fit_head({64: 0.001, 256: 0.010}) == HeadCost(0.0, 0.010 / 256)


def test_head_cost_is_measured_positive() -> None:
    cost = head_cost(CONFIGS["gpt-tiny"])
    assert cost.alpha >= 0 and cost.per_token > 0


def test_measured_head_joins_each_micro_batch_and_leaves_the_compute() -> None:
    """With a measured head the compute term loses the head's 6·V·h FLOPs per token, and each micro-batch
    pays the head at its own tokens (s/cp of b sequences), ÷ tp; the pipeline bubble stretches it too."""
    model, head = ModelSpec.of(NANO), HeadCost(1e-3, 2e-6)
    plain, measured = _cpu(), _cpu(head)
    for layout, batch in ((Layout(1, 1, 1, micro_batch=4), 8), (Layout(1, 2, 1, micro_batch=2, sp=True), 8)):
        a = estimate_time(model, layout, plain, FP32, batch)
        b = estimate_time(model, layout, measured, FP32, batch)
        m, tokens = layout.micro_batches(batch), layout.micro_batch * NANO.seq_len
        assert b.head == pytest.approx(m * head.seconds(tokens) / layout.tp)
        head_flops = model.head_flops_per_token * batch * NANO.seq_len / layout.tp
        assert a.compute - b.compute == pytest.approx(head_flops / 1e10)
        assert a.head == 0
    cp = Layout(1, 1, 1, micro_batch=4, cp=2)
    halves = head.seconds(4 * NANO.seq_len / 2)  # each cp rank's micro-batch: s/cp tokens of 4 sequences
    assert estimate_time(model, cp, measured, FP32, 8).head == pytest.approx(2 * halves)
    pipe = Layout(1, 1, 2, micro_batch=2, schedule="1f1b")
    with_head = estimate_time(model, pipe, measured, FP32, 8)
    m, p = pipe.micro_batches(8), 2
    assert with_head.bubble == pytest.approx((with_head.compute + with_head.head) * (p - 1) / m)


def test_gpu_presets_keep_the_head_in_the_compute() -> None:
    """No head measured on a datasheet preset: its FLOPs stay in compute; the step's two scalar
    all-reduces cost their link's latency."""
    hw = hardware("a100-80gb")
    assert hw.head is None
    model, layout = ModelSpec.of(CONFIGS["gpt2"]), Layout(8, 1, 1, micro_batch=4)
    time = estimate_time(model, layout, hw, Precision("bf16"), 64)
    assert time.head == 0
    rate = hw.peak("bf16") * hw.efficiency.at(2 * 4 * 1024 * 768 * 4 * 768)
    assert time.compute == pytest.approx(model.flops_per_token() * 64 * 1024 / 8 / rate)
    assert 0 < time.sync < 1e-3


def test_sync_is_one_loss_and_one_norm_all_reduce() -> None:
    """The loss over the replicas (dp·ep·cp), the gradient norm over every rank, each at the measured cost
    of an all-reduce on that group; nothing on one rank."""
    calls = (CallCost("all_reduce", 2, 1e-3, 0.0), CallCost("all_reduce", 4, 3e-3, 0.0))
    hw = _cpu(calls=calls)
    assert sync_seconds(Layout(1, 1, 1), hw) == 0
    assert sync_seconds(Layout(2, 1, 1), hw) == pytest.approx(2e-3)
    assert sync_seconds(Layout(1, 2, 1), hw) == pytest.approx(1e-3)  # tp ranks are no replicas
    assert sync_seconds(Layout(2, 2, 1), hw) == pytest.approx(1e-3 + 3e-3)
    assert sync_seconds(Layout(1, 1, 1, cp=2), hw) == pytest.approx(2e-3)


def test_clip_as_trained_is_torchs_rule() -> None:
    torch.manual_seed(0)
    grads = [torch.randn(7, 5) * 3, torch.randn(11)]
    expected = [g.clone() for g in grads]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, expected, strict=True):
        p.grad = g
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    clip_as_trained(grads)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e)


def test_context_parallel_holds_gathered_keys_and_values_and_its_gradients() -> None:
    """cp2: the gathered sequence's keys and values twice during one layer (fused kernel), one copy kept
    per layer on the explicit-mask path; the cp ranks' gradient reducer keeps the gradients alive, so the
    one-micro-batch saving (activations freed before the gradients exist) does not apply."""
    b, s, h = 8, NANO.seq_len, NANO.hidden
    gathered = 2 * b * s * h * 4
    cp = Layout(1, 1, 1, micro_batch=b, cp=2)
    assert context_parallel_buffers(NANO, b, cp, FP32, "flash") == (2 * gathered, 0.0)
    assert context_parallel_buffers(NANO, b, cp, FP32, "math") == (gathered, gathered)
    assert context_parallel_buffers(NANO, b, replace(cp, tp=2), FP32)[0] == gathered
    assert context_parallel_buffers(NANO, b, Layout(1, 1, 1, micro_batch=b), FP32) == (0.0, 0.0)
    model, hw = ModelSpec.of(NANO), _cpu()
    alone = estimate_memory(model, Layout(1, 1, 1, micro_batch=b), hw, FP32, b, attention="flash")
    split = estimate_memory(model, cp, hw, FP32, b, attention="flash")
    assert alone.released > 0 and split.released == 0
    assert split.gather_buffers == 2 * gathered
    assert split.activations == pytest.approx(alone.activations / 2)
