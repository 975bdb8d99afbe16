"""meshwise plan: the published figures it must reproduce, its formulas against what our GPT saves, its
pipeline and communication terms against the simulator and the cost model, and bad input in one line."""

from __future__ import annotations

import copy
import gc
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshwise.cli import main
from meshwise.comm.algorithms.registry import predict_seconds
from meshwise.models.gpt import CONFIGS, GPT, GPTConfig
from meshwise.models.gpt_activations import (
    dropout_mask_bytes,
    layer_activation_report,
    saved_activation_bytes,
)
from meshwise.models.gpt_plan import tensor_parallel
from meshwise.parallel.pipeline_parallel.schedules import build_schedule
from meshwise.parallel.pipeline_parallel.simulator import simulate
from meshwise.parallel.recompute import apply_recompute
from meshwise.plan import Layout, ModelSpec, Precision, Problem, advise, hardware
from meshwise.plan.memory import layer_activations
from meshwise.plan.model import MEGATRON_SEQ, MEGATRON_TABLE, MEGATRON_VOCAB, narayanan_parameters
from meshwise.plan.step_time import all_reduce_seconds, dp_layout, estimate_time
from meshwise.runtime.spawn import spawn
from meshwise.train.gpt.peak_memory import PERIOD, PeakMemory


def test_zero_paper_figure_1_is_printed(capsys) -> None:
    """Rajbhandari et al., Figure 1: Ψ = 7.5B, N = 64, mixed-precision Adam (K = 12)."""
    assert main(["plan", "--params", "7.5e9", "--gpus", "64", "--gpu", "a100-80gb"]) == 0
    out = capsys.readouterr().out
    assert "DDP 120.0 GB · ZeRO-1 31.4 GB · ZeRO-2 16.6 GB · ZeRO-3 1.9 GB" in out


@pytest.mark.parametrize(("published", "heads", "hidden", "layers"), MEGATRON_TABLE)
def test_narayanan_parameter_counts(published: float, heads: int, hidden: int, layers: int) -> None:
    """Eq. 2 and our GPT agree within 0.1 % (ours adds the final LayerNorm's 2h), and both round to the
    published size (Table 1 gives one decimal in billions)."""
    config = GPTConfig(layers, hidden, heads, MEGATRON_SEQ, MEGATRON_VOCAB)
    ours = ModelSpec.of(config).parameters
    eq2 = narayanan_parameters(layers, hidden, MEGATRON_VOCAB, MEGATRON_SEQ)
    assert abs(ours / eq2 - 1) < 1e-3
    assert round(eq2 / 1e9, 1) == pytest.approx(published / 1e9)


def test_parameter_count_is_the_modules() -> None:
    """The count the planner prices is what the GPT module holds (built on the meta device: no memory)."""
    config = GPTConfig(24, 2304, 24, MEGATRON_SEQ, MEGATRON_VOCAB)
    with torch.device("meta"):
        model = GPT(config)
    assert sum(p.numel() for p in model.parameters()) == ModelSpec.of(config).parameters


class _Checkpointed(nn.Module):
    """A block under full activation recomputation: only its input is kept for backward."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


@pytest.mark.parametrize(
    ("dropout", "recompute", "attention"),
    [(0.0, "none", "flash"), (0.1, "none", "math"), (0.0, "full", "flash"), (0.1, "full", "math")],
)
def test_activation_formula_against_saved_tensors(dropout: float, recompute: str, attention: str) -> None:
    """What one block saves for backward (saved-tensor hooks, fp32, CPU) within 10 % of the formula.

    The CPU's scaled_dot_product_attention runs a fused kernel without dropout (it saves its output and a
    log-sum-exp per row, no s×s scores: the "flash" formula) and the math path with dropout (scores,
    their dropout mask and the dropped-out scores: Korthikanti's 5·as²b terms, with CPU's float mask)."""
    config = replace(CONFIGS["gpt-tiny"], dropout=dropout)
    torch.manual_seed(0)
    block = GPT(config).train().blocks[0]
    module = _Checkpointed(block) if recompute == "full" else block
    x = torch.randn(2, config.seq_len, config.hidden, requires_grad=True)
    measured = saved_activation_bytes(module, x)
    formula = layer_activations(
        config, 2, Layout(1, 1, 1, recompute=recompute), Precision("fp32"), attention=attention,
        mask_bytes=dropout_mask_bytes() if dropout else 0,
    )  # fmt: skip
    assert abs(measured / formula - 1) <= 0.10, (measured, formula)


@pytest.mark.parametrize(("dropout", "attention"), [(0.0, "flash"), (0.1, "math")])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_activation_formula_under_train_gpt_recompute(dropout: float, attention: str, recompute: str) -> None:
    """The block as ``train gpt --recompute`` runs it (the library's policy, not a hand-made checkpoint):
    selective keeps the layer's 34·sbh without the s² terms (its attention core is recomputed, whatever
    kernel that core runs), full keeps the block's input only."""
    config = replace(CONFIGS["gpt-tiny"], dropout=dropout)
    torch.manual_seed(0)
    block = GPT(config).train().blocks[0]
    apply_recompute([block], recompute)
    x = torch.randn(2, config.seq_len, config.hidden, requires_grad=True)
    measured = saved_activation_bytes(block, x)
    formula = layer_activations(
        config, 2, Layout(1, 1, 1, recompute=recompute), Precision("fp32"), attention=attention,
        mask_bytes=dropout_mask_bytes() if dropout else 0,
    )  # fmt: skip
    assert abs(measured / formula - 1) <= 0.10, (measured, formula)


def _recompute_rows(dropout: float) -> dict:
    """On each of 2 ranks: one TP (and TP+SP) layer's saved bytes under each ``--recompute`` mode."""
    import meshwise

    world = meshwise.init(backend="gloo", timeout=60)
    try:
        config = replace(CONFIGS["gpt-tiny"], dropout=dropout)
        torch.manual_seed(0)
        full = GPT(config).train()
        rows = {}
        for sp in (False, True):
            model = tensor_parallel(copy.deepcopy(full), world.comm, sequence_parallel=sp).train()
            for mode in ("selective", "full"):
                apply_recompute([model.blocks[0]], mode)
                x = torch.randn(2, config.seq_len // (2 if sp else 1), config.hidden, requires_grad=True)
                rows[(sp, mode)] = saved_activation_bytes(model.blocks[0], x)
        return rows
    finally:
        meshwise.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(("dropout", "attention"), [(0.0, "flash"), (0.1, "math")])
def test_activation_formula_tensor_parallel_recompute(dropout: float, attention: str) -> None:
    """The planner's per-layer bytes under selective and full recomputation on a rank of a 2-way TP and
    TP+SP layer (full with SP keeps the rank's s/t slice of the input: 2·sbh/t)."""
    rows = spawn(_recompute_rows, 2, (dropout,), timeout=120)[0]
    config = replace(CONFIGS["gpt-tiny"], dropout=dropout)
    mask = dropout_mask_bytes() if dropout else 0
    for (sp, mode), measured in rows.items():
        layout = Layout(1, 2, 1, recompute=mode, sp=sp)
        formula = layer_activations(
            config, 2, layout, Precision("fp32"), attention=attention, mask_bytes=mask
        )
        assert abs(measured / formula - 1) <= 0.10, (sp, mode, measured, formula)


def _tensor_parallel_rows(dropout: float) -> dict:
    """On each of 2 ranks: one layer's saved bytes in one process, TP and TP+SP (the library's report)."""
    import meshwise

    world = meshwise.init(backend="gloo", timeout=60)
    try:
        config = replace(CONFIGS["gpt-tiny"], dropout=dropout)
        return layer_activation_report(config, world.comm, batch=2)
    finally:
        meshwise.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(("dropout", "attention"), [(0.0, "flash"), (0.1, "math")])
def test_activation_formula_tensor_parallel(dropout: float, attention: str) -> None:
    """The planner's per-layer bytes against what a rank of a 2-way TP (and TP+SP) layer saves."""
    rows = spawn(_tensor_parallel_rows, 2, (dropout,), timeout=120)[0]
    config = replace(CONFIGS["gpt-tiny"], dropout=dropout)
    mask = dropout_mask_bytes() if dropout else 0
    for name, tp, sp in (("one process", 1, False), ("tp", 2, False), ("tp+sp", 2, True)):
        layout = Layout(1, tp, 1, sp=sp)
        precision = Precision("fp32")
        formula = layer_activations(config, 2, layout, precision, attention=attention, mask_bytes=mask)
        assert abs(rows[name]["measured"] / formula - 1) <= 0.10, (name, rows[name], formula)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_in_flight_and_bubble_agree_with_the_simulator(schedule: str) -> None:
    """The closed forms the memory and time models use equal the simulator's peak in-flight activations
    (first rank) and idle fraction on every small case."""
    for p in (2, 3, 4):
        for m in (1, 2, 4, 6, 8, 12):
            for v in (1, 2, 3) if schedule == "interleaved" else (1,):
                if schedule == "interleaved" and m % p:
                    continue
                layout = Layout(dp=1, tp=1, pp=p, micro_batch=1, schedule=schedule, virtual=v)
                sim = simulate(build_schedule(schedule, p, m, v))
                assert layout.in_flight(m) == sim.peak_in_flight[0], (p, m, v)
                assert layout.bubble(m) == pytest.approx(sim.bubble), (p, m, v)


def _problem(gpu: str = "a100-80gb", config: str = "gpt2-medium", batch: int = 64) -> Problem:
    return Problem(ModelSpec.of(CONFIGS[config]), hardware(gpu), Precision("bf16"), batch, 16)


def test_communication_terms_are_the_cost_models() -> None:
    """TP: four ring all-reduces of b·s·h values per layer and micro-batch on NVLink, two more at the ends
    (embedding, head) and the loss's two of b·s fp32 values, each call priced alone; dp: the cheapest
    of ring and tree within a node, hierarchical (NVLink + InfiniBand) across nodes."""
    problem = _problem()
    hw, c = problem.hardware, problem.model.config
    layout = Layout(dp=8, tp=2, pp=1, micro_batch=2)
    time = estimate_time(problem.model, layout, hw, problem.precision, problem.global_batch)
    message = 2 * c.seq_len * c.hidden * 2
    link = hw.link_params(False)
    per_mb = (c.layers * 4 + 2) * predict_seconds("all_reduce", "ring", message, 2, link)
    per_mb += 2 * predict_seconds("all_reduce", "ring", 2 * c.seq_len * 4, 2, link)
    assert time.tensor_parallel == pytest.approx(layout.micro_batches(64) * per_mb)
    assert dp_layout(layout, hw) == (4, True)  # 8 GPUs per node / tp 2: four dp ranks per node
    nbytes = 1e9
    intra, inter = hw.link_params(False), hw.link_params(True)
    hierarchical = predict_seconds("all_reduce", "hierarchical", nbytes, 8, intra, inter=inter, local_size=4)
    flat = min(predict_seconds("all_reduce", a, nbytes, 8, inter) for a in ("ring", "tree"))
    assert all_reduce_seconds(nbytes, 8, hw, 4, True) == pytest.approx(min(hierarchical, flat))
    assert hierarchical < flat  # the point of hierarchical: only 1/L of the bytes cross nodes
    within = min(predict_seconds("all_reduce", a, nbytes, 4, intra) for a in ("ring", "tree"))
    assert all_reduce_seconds(nbytes, 4, hw, 4, False) == pytest.approx(within)


def test_advisor_ranks_fitting_layouts_and_explains_neighbours() -> None:
    problem = Problem(ModelSpec.from_parameters(7.5e9), hardware("a100-80gb"), Precision(), 512, 64)
    plan = advise(problem)
    assert plan.ranked and all(c.fits for c in plan.ranked)
    steps = [c.time.step for c in plan.ranked]
    assert steps == sorted(steps)
    assert plan.neighbours and all(why for _, why in plan.neighbours)
    assert any(why.startswith("out of memory by") for _, why in plan.neighbours)
    fixed = advise(problem, {"dp": 8, "tp": 8, "pp": 1, "zero": 1, "micro_batch": 4, "recompute": "none"})
    assert [c.layout for c in fixed.ranked] in ([], [Layout(8, 8, 1, 1, 4, "1f1b", 1, "none", True)])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config", "gpt2", "--gpus", "8", "--tp", "5"], "does not divide --gpus 8"),
        (["--config", "gpt2", "--gpus", "10", "--tp", "5", "--dp", "2"], "does not divide the 12 attention"),
        (["--config", "gpt2", "--gpus", "8", "--gpu", "b200"], "unknown --gpu 'b200'"),
        (["--config", "gpt2", "--gpus", "8", "--dp", "8", "--global-batch", "12"], "not divisible by dp 8"),
        (["--config", "gpt2", "--gpus", "8", "--dp", "4", "--pp", "3"], "does not divide --gpus 8"),
        (["--params", "7e9", "--gpus", "8", "--pp", "8", "--dp", "1", "--global-batch", "8", "--micro-batch",
          "3"], "does not divide the per-rank batch 8"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line(capsys, argv: list[str], message: str) -> None:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshwise plan: error:") and message in err and "\n" not in err, err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_plan_speed_section_runs(tmp_path) -> None:
    """The benchmark's speed part writes its figures (the accuracy part runs trials for minutes)."""
    out = tmp_path / "plan.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_plan.py"
    argv = [sys.executable, str(script), "--skip-accuracy", "--repeat", "1", "--json", str(out)]
    subprocess.run(argv, check=True, capture_output=True, timeout=280)
    speed = json.loads(out.read_text())["speed"]
    assert speed["layouts_priced"] > 10_000 and speed["advisor_cpu_seconds"] > 0 and "best" in speed


def test_json_and_plot_outputs(capsys, tmp_path) -> None:
    """--json - is the whole plan as JSON on stdout (no report), --plot writes an image."""
    plot = tmp_path / "plan.png"
    assert main(["plan", "--config", "gpt2", "--gpus", "8", "--global-batch", "64", "--json", "-", "--plot",
                 str(plot)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    data = json.loads(out[: out.rindex("}") + 1])
    assert data["best"]["memory"]["fits"] and data["ranked"][0]["name"] == data["best"]["name"]
    assert set(data["zero_model_states"]) == {"0", "1", "2", "3"} and data["neighbours"]
    assert plot.stat().st_size > 10_000


def test_peak_memory_counts_the_bytes_held_during_the_steps() -> None:
    """The trainer's probe: a 64 MiB tensor held for a few sampling periods after training starts is
    counted (allocated bytes, not resident ones) and nothing from before it is."""
    gc.collect()  # earlier tests' garbage freed now, not while the probe counts (it would lower the count)
    probe = PeakMemory(CONFIGS["gpt-tiny"], 1, torch.device("cpu"))
    before = torch.ones(2**22)  # 16 MiB during "setup"
    probe.training_starts()
    del before
    held = torch.ones(2**24)  # 64 MiB
    time.sleep(20 * PERIOD)
    del held
    measured = probe.stop()
    # allocated bytes are the process's, not the tensors': allow 1 MiB freed or allocated beside them
    assert 63 * 2**20 <= measured["allocated"] < 68 * 2**20, measured
    assert measured["setup_allocated"] >= 15 * 2**20, measured


@pytest.mark.timeout(240)
def test_train_gpt_reports_peak_memory_above_its_model_states(tmp_path) -> None:
    """``train gpt --json`` carries the fullest rank's peak allocated bytes: at least the model states
    the plan counts (4 + 4 + 8 bytes per parameter of fp32 AdamW), and within the plan's whole estimate
    plus the few MiB any step allocates besides (autograd's graph, gloo's buffers: < 8 MiB)."""
    out = tmp_path / "run.json"
    argv = ["train", "gpt", "-np", "2", "--config", "gpt-tiny", "--steps", "2", "--global-batch", "4",
            "--backend", "gloo", "--device", "cpu", "--eval-every", "2", "--eval-windows", "2",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    allocated = json.loads(out.read_text())["peak_memory"]["allocated"]
    model = ModelSpec.of(CONFIGS["gpt-tiny"])
    problem = Problem(model, hardware("a100-80gb"), Precision("fp32"), 4, 2)
    estimate = problem.memory(Layout(2, 1, 1, micro_batch=2))
    assert estimate.model_states <= allocated <= estimate.total - estimate.reserved + 8 * 2**20, (
        allocated, estimate)  # fmt: skip


def test_cpu_rank_threads_leave_the_busy_cores_alone() -> None:
    """A lone rank keeps 2 threads only where 2 cores are free; ranks split the cores otherwise."""
    from meshwise.plan.hardware import rank_threads

    assert rank_threads(1, 2, 0.2) == 2 and rank_threads(1, 2, 13.0) == 1 and rank_threads(4, 2, 0.0) == 1


def test_rank_speedup_is_measured_and_bounded() -> None:
    """Work run by 2 threads at once: at most twice what one gets done, and more than nothing."""
    from meshwise.plan.hardware import rank_speedup

    a = torch.randn(128, 128)
    assert 0 < rank_speedup(lambda: a @ a, 2, seconds=0.05) <= 2.0
    assert rank_speedup(lambda: a @ a, 1) == 1.0


def test_gloo_link_is_the_measured_pair() -> None:
    """Two local ranks' point-to-point link from the 2-endpoint all-reduce (2α + n·β): half its latency,
    its bandwidth; none without that measurement."""
    from meshwise.plan.gloo_calls import CallCost
    from meshwise.plan.hardware import gloo_link

    link = gloo_link((CallCost("all_gather", 2, 1e-3, 1e-9), CallCost("all_reduce", 2, 4e-4, 2e-9)))
    assert link is not None and link.latency == pytest.approx(2e-4) and link.bandwidth == pytest.approx(5e8)
    assert gloo_link(()) is None
