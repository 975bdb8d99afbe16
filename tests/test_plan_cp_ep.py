"""Context and expert parallelism in the planner: their memory and time terms against the formulas they
stand for, the search and the trial flags, and bad input in one line."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshwise.cli import main
from meshwise.cli.plan_validate import model_flags, trial_layout
from meshwise.comm.algorithms.registry import predict_seconds
from meshwise.models.gpt import CONFIGS
from meshwise.plan import Layout, ModelSpec, Precision, Problem, advise, hardware
from meshwise.plan.memory import layer_activations, rank_parameter_kinds, rank_parameters, sharded_states
from meshwise.plan.step_time import estimate_time

MOE = CONFIGS["gpt-moe-nano"]  # 6 layers, hidden 384, 8 experts, top-2, seq 256


def test_context_parallel_divides_activations_and_prices_the_ring() -> None:
    """cp 2: each layer keeps half the bytes per rank (s/cp tokens), and its time per layer and
    micro-batch is the attention's all-gather of keys and values forward, the re-gather and the
    gradients' reduce-scatter backward (the all-gather design of parallel/context_parallel)."""
    config, precision = CONFIGS["gpt-nano"], Precision("bf16")
    one = layer_activations(config, 4, Layout(1, 1, 1), precision, attention="flash")
    two = layer_activations(config, 4, Layout(1, 1, 1, cp=2), precision, attention="flash")
    assert two == pytest.approx(one / 2)
    hw = hardware("a100-80gb")
    layout = Layout(2, 1, 1, micro_batch=4, cp=2)
    time = estimate_time(ModelSpec.of(config), layout, hw, precision, 64)
    kv = 2 * 4 * config.seq_len * config.hidden * 2  # the sequence's keys and values, bf16, all slots
    link = hw.link_params(False)
    gather, scatter = (predict_seconds(op, "ring", kv, 2, link) for op in ("all_gather", "reduce_scatter"))
    per_mb = config.layers * (2 * gather + scatter)
    assert time.context_parallel == pytest.approx(layout.micro_batches(64) * per_mb)


def test_expert_parallel_divides_experts_and_prices_the_all_to_alls() -> None:
    """ep 2 holds E/2 whole experts per rank; active parameters (router + top-k experts) set the FLOPs;
    each MoE layer's dispatch and combine run forward and backward: 4 all-to-alls of b·s·k·h values."""
    model, precision = ModelSpec.of(MOE), Precision("bf16")
    h = MOE.hidden
    dropped = rank_parameters(model, Layout(1, 1, 1)) - rank_parameters(model, Layout(1, 1, 1, ep=2))
    assert dropped == MOE.layers * MOE.experts // 2 * (8 * h * h + 5 * h)
    assert model.active_parameters == pytest.approx(MOE.num_parameters(active=True))
    assert model.active_parameters < model.parameters
    hw = hardware("a100-80gb")
    layout = Layout(2, 1, 1, micro_batch=2, ep=2)
    time = estimate_time(model, layout, hw, precision, 32)
    nbytes = 2 * MOE.seq_len * MOE.top_k * h * 2
    one = predict_seconds("all_to_all", "pairwise", nbytes, 2, hw.link_params(False))
    assert time.expert_parallel == pytest.approx(layout.micro_batches(32) * MOE.layers * 4 * one)
    assert layout.micro_batches(32) == 32 // (2 * 2 * 2)  # dp·ep ranks read different sequences


def test_zero_shards_dense_weights_over_dp_ep_cp_and_experts_over_dp_cp() -> None:
    """As train gpt --zero N shards them (zero_step: mesh.replicas for the dense parameters, a rank's
    experts over mesh.expert_replicas): ep2·dp2 ZeRO-1 keeps 1/4 of the dense optimizer state and 1/2
    of its own experts'; cp2 ZeRO-3 divides every state by dp·cp."""
    model, precision = ModelSpec.of(MOE), Precision("bf16")
    layout = Layout(2, 1, 1, micro_batch=2, ep=2, zero=1)
    dense, experts = rank_parameter_kinds(model, layout)
    assert dense + experts == pytest.approx(rank_parameters(model, layout)) and experts > dense
    weights, grads, optimizer = sharded_states(model, layout, precision)
    k = precision.optimizer_bytes
    assert optimizer == pytest.approx(k * (dense / 4 + experts / 2))
    assert weights == grads == pytest.approx(2 * (dense + experts))  # stage 1 shards the optimizer only
    dense_model = ModelSpec.of(CONFIGS["gpt-nano"])
    cp = Layout(1, 1, 1, micro_batch=2, cp=2, zero=3)
    psi = rank_parameters(dense_model, cp)
    assert sum(sharded_states(dense_model, cp, precision)) == pytest.approx((4 + k) * psi / 2)


def test_search_walks_ep_for_experts_and_cp_when_given() -> None:
    problem = Problem(ModelSpec.of(MOE), hardware("a100-80gb"), Precision(), 64, 4)
    assert {c.layout.ep for c in advise(problem).ranked} == {1, 2, 4}
    dense = Problem(ModelSpec.of(CONFIGS["gpt-nano"]), hardware("a100-80gb"), Precision(), 64, 4)
    assert {c.layout.cp for c in advise(dense).ranked} == {1}
    assert {c.layout.cp for c in advise(dense, {"cp": 2}).ranked} == {2}


def test_validate_runs_cp_and_ep_layouts_with_their_flags() -> None:
    """What --validate hands train gpt: the cp / ep sizes, and the experts that make the model a MoE."""
    flags = trial_layout(Layout(1, 1, 1, micro_batch=2, cp=2, ep=2))
    assert flags["cp"] == 2 and flags["ep"] == 2
    assert "cp" not in trial_layout(Layout(2, 1, 1))
    assert model_flags(replace(CONFIGS["gpt-nano"], experts=4, top_k=1)) == ("--experts", "4", "--top-k", "1")
    assert model_flags(CONFIGS["gpt-nano"]) == ()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config", "gpt-nano", "--gpus", "4", "--ep", "2"], "--ep 2 needs a mixture of experts"),
        (["--config", "gpt-nano", "--gpus", "4", "--experts", "6", "--ep", "4"], "not divisible by --ep 4"),
        (["--config", "gpt-nano", "--gpus", "4", "--cp", "2", "--seq-len", "66"], "not divisible by 2·cp"),
        (["--config", "gpt-nano", "--gpus", "4", "--cp", "3"], "does not divide --gpus 4"),
        (["--config", "gpt-nano", "--gpus", "4", "--cp", "0"], "--cp must be at least 1"),
        (["--params", "1e9", "--gpus", "8", "--experts", "4"], "--experts needs a shape"),
        (["--config", "gpt-nano", "--gpus", "4", "--top-k", "2"], "--top-k needs a mixture of experts"),
        (["--config", "gpt-nano", "--gpus", "4", "--experts", "4", "--top-k", "5"], "--top-k 5 must"),
    ],
)  # fmt: skip
def test_bad_cp_and_ep_input_is_one_line(capsys, argv: list[str], message: str) -> None:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshwise plan: error:") and message in err and "\n" not in err, err
