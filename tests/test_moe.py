"""Mixture of experts and expert parallelism: routing, auxiliary losses and counts as plain functions; the
MoE GPT against the dense one; ep2, ep4 and ep2·dp2 against one process (tests/moe_checks.py)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tests.moe_checks import CONFIG, checkpoint_across_ep, run_checks

from conftest import meshwise_here
from meshwise.models.gpt import CONFIGS, GPT, GPTConfig, language_model_loss
from meshwise.models.moe import (
    combine,
    group_by_expert,
    moe_layers,
    route,
    run_here,
    with_auxiliary_losses,
)
from meshwise.parallel.expert_parallel import check_expert_parallel, local_experts, moe_report
from meshwise.parallel.expert_parallel.exchange import expert_major_order
from meshwise.runtime.spawn import spawn

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
#: fp32, rank-local sums over tokens in another order (experts see the ranks' rows concatenated): a few
#: units in the last place of values of order 1, nothing else
TOLERANCE = 1e-6


def test_route_picks_top_k_and_keeps_probabilities() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.5]])
    routing = route(logits, top_k=2)
    assert routing.experts.tolist() == [[1, 2], [0, 3]]
    probs = logits.softmax(dim=-1)
    assert torch.equal(routing.weights, probs.gather(1, routing.experts))
    assert routing.kept.all() and routing.routed.tolist() == [1, 1, 1, 1]


def test_capacity_drops_second_choices_first_then_later_tokens() -> None:
    # 4 tokens, 2 experts, top-2, capacity factor 0.5: ⌈0.5·4·2/2⌉ = 2 slots per expert.
    logits = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    routing = route(logits, top_k=2, capacity_factor=0.5)
    # first choices: expert 0 ← tokens 0, 1, 3 (token 3 over capacity), expert 1 ← token 2; second choices:
    # expert 1 ← token 0 (its second slot), every other second choice is over capacity
    assert routing.kept.tolist() == [[True, True], [True, False], [True, False], [False, False]]
    assert routing.kept_per_expert().tolist() == [2, 2] and routing.routed.tolist() == [4, 4]


def test_auxiliary_losses_at_uniform_routing() -> None:
    """Equal logits: Switch's balance loss is exactly its minimum 1, the z-loss log(E)²."""
    routing = route(torch.zeros(6, 4), top_k=2)
    assert routing.balance_loss.item() == pytest.approx(1.0)
    assert routing.z_loss.item() == pytest.approx(math.log(4) ** 2)


def test_local_round_trip_with_identity_experts_and_its_gradient() -> None:
    x = torch.randn(10, 8, requires_grad=True)
    logits = torch.randn(10, 4, requires_grad=True)
    routing = route(logits, top_k=2, capacity_factor=0.75)
    grouped, counts, order = group_by_expert(x, routing)
    assert counts.tolist() == routing.kept_per_expert().tolist()
    mixed = combine(run_here(grouped, counts, lambda rows, _: rows), order, routing, 10)
    kept_weights = (routing.weights * routing.kept).sum(dim=1, keepdim=True)
    torch.testing.assert_close(mixed, x * kept_weights)
    mixed.sum().backward()
    torch.testing.assert_close(x.grad, kept_weights.detach().expand(-1, 8))


def test_one_expert_top_one_is_the_dense_gpt() -> None:
    """E = 1, k = 1: the router's probability is exactly 1, so the MoE GPT computes the dense GPT."""
    config = GPTConfig(layers=2, hidden=32, heads=4, seq_len=8, vocab=64)
    torch.manual_seed(0)
    dense = GPT(config)
    moe = GPT(replace(config, experts=1, top_k=1))
    state = {k.replace("mlp.", "mlp.experts.0."): v for k, v in dense.state_dict().items()}
    missing = moe.load_state_dict(state, strict=False).missing_keys
    assert all(key.endswith("router.weight") for key in missing) and len(missing) == config.layers
    tokens = torch.randint(0, 64, (3, 8))
    torch.testing.assert_close(moe(tokens), dense(tokens), rtol=0, atol=1e-6)


def test_auxiliary_losses_change_the_gradient_not_the_loss() -> None:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab, (2, CONFIG.seq_len + 1))
    lm = language_model_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss = with_auxiliary_losses(lm, model)
    assert loss.item() == lm.item()
    aux = sum(layer.auxiliary_loss() for layer in moe_layers(model))
    router = model.blocks[0].mlp.router.weight
    (got,) = torch.autograd.grad(loss, router, retain_graph=True)
    (want,) = torch.autograd.grad(lm + aux, router)
    torch.testing.assert_close(got, want)


def test_parameter_counts_total_and_active() -> None:
    config = CONFIGS["gpt-moe-tiny"]
    assert sum(p.numel() for p in GPT(config).parameters()) == config.num_parameters()
    h, mlp, dense = config.hidden, 8 * config.hidden**2 + 5 * config.hidden, CONFIGS["gpt-tiny"]
    extra_per_layer = h * config.experts + (config.experts - 1) * mlp
    assert config.num_parameters() == dense.num_parameters() + config.layers * extra_per_layer
    active_extra = h * config.experts + (config.top_k - 1) * mlp
    assert config.num_parameters(active=True) == dense.num_parameters() + config.layers * active_extra
    assert config.flops_per_token() == dense.flops_per_token() + 6 * config.layers * active_extra


def test_expert_init_is_the_plain_mlps() -> None:
    """Biases zero; fc N(0, 0.02); proj the residual std 0.02/√(2·layers) (measured over many weights)."""
    torch.manual_seed(0)
    layer = GPT(CONFIGS["gpt-moe-tiny"]).blocks[0].mlp
    residual = 0.02 / math.sqrt(2 * CONFIGS["gpt-moe-tiny"].layers)
    for expert in layer.experts.values():
        assert expert.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
        assert expert.proj.weight.std().item() == pytest.approx(residual, rel=0.05)
        assert not expert.fc.bias.any() and not expert.proj.bias.any()


def test_report_counts_and_resets() -> None:
    torch.manual_seed(0)
    model = GPT(replace(CONFIG, capacity_factor=0.5))
    model(torch.randint(0, CONFIG.vocab, (2, CONFIG.seq_len)))
    report = moe_report(model)
    tokens = 2 * CONFIG.seq_len * CONFIG.top_k  # assignments per layer
    assert report.assignments == CONFIG.layers * tokens
    assert report.tokens_mean == tokens / CONFIG.experts
    # capacity ⌈0.5·16·2/4⌉ = 4 per expert: at most 16 of 32 assignments kept per layer
    assert report.dropped >= CONFIG.layers * (tokens - 4 * CONFIG.experts)
    assert moe_report(model).assignments == 0  # reset
    assert moe_report(GPT(replace(CONFIG, experts=0))) is None


def test_expert_major_order() -> None:
    # 2 source ranks × 2 local experts: rows [s0e0, s0e0, s0e1, s1e0, s1e1, s1e1]
    order = expert_major_order(torch.tensor([[2, 1], [1, 2]]))
    assert order.tolist() == [0, 1, 3, 2, 4, 5]
    assert list(local_experts(8, 4, 2)) == [4, 5]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"experts": 4, "top_k": 5}, "--top-k 5 must be between 1 and the number of experts (4)"),
        ({"experts": 4, "capacity_factor": 0.0}, "--capacity-factor must be a positive number"),
        ({"experts": -1}, "--experts must be at least 1"),
    ],
)
def test_bad_moe_config_names_the_flag(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        replace(CONFIGS["gpt-tiny"], **overrides).validate()


def test_experts_not_divisible_by_ep() -> None:
    with pytest.raises(ValueError, match=r"--experts 6 is not divisible by --ep 4:.* --ep in \[1, 2, 3, 6\]"):
        check_expert_parallel(6, 4)
    check_expert_parallel(8, 4)


def _assert_parity(results: list[dict]) -> None:
    for rank in results:
        for label, errors in rank["round_trip"].items():
            assert max(errors[k] for k in ("value", "dx", "dlogits")) < TOLERANCE, (label, errors)
        assert rank["round_trip"]["capacity"]["dropped"] > 0  # the capacity case does drop
        for key, diffs in rank.items():
            if key.startswith("gpt"):
                assert diffs["counts_equal"], (key, diffs)
                assert max(diffs[k] for k in ("loss", "grads", "weights", "aux")) < TOLERANCE, (key, diffs)
                assert diffs["experts_held"] == diffs["experts_expected"]


def _assert_skew(results: list[dict], ranks: int) -> None:
    """All tokens on expert 0: every parameter still gets a finite gradient, the report's max is every
    assignment of a layer, the imbalance E; with capacity factor 1 each rank keeps ⌈T/E⌉ per layer and
    drops the rest."""
    tokens = 2 * CONFIG.seq_len  # per rank per layer (top-1)
    for rank in results:
        for capacity, run in rank["skewed"].items():
            report = run["report"]
            assert run["finite"]
            assert report["tokens_max"] == ranks * tokens and report["tokens_min"] == 0
            assert report["tokens_max"] / report["tokens_mean"] == CONFIG.experts
            kept = ranks * math.ceil(tokens / CONFIG.experts) if capacity is not None else ranks * tokens
            assert report["dropped"] == CONFIG.layers * (ranks * tokens - kept)


@pytest.mark.parametrize(
    ("backend", "ranks"),
    [
        ("gloo", 2),
        pytest.param("shm", 2, marks=pytest.mark.slow),
        pytest.param("gloo", 4, marks=pytest.mark.slow),
    ],
)
def test_ep_equals_one_process(backend: str, ranks: int) -> None:
    """ep over the whole world, dropless and with a capacity factor, plus the skewed router."""
    results = spawn(run_checks, ranks, (backend, ranks), timeout=115)
    _assert_parity(results)
    _assert_skew(results, ranks)


@pytest.mark.slow
def test_ep2_dp2_equals_one_process() -> None:
    """ep groups {0,1}, {2,3}; experts replicated across them and reduced over {0,2}, {1,3}."""
    results = spawn(run_checks, 4, ("gloo", 2), timeout=115)
    _assert_parity(results)
    assert [r["gpt:ep·dp"]["experts_held"] for r in results] == [["0", "1"], ["2", "3"]] * 2


@pytest.mark.slow
def test_bench_moe_script_writes_every_layout(tmp_path, monkeypatch) -> None:
    """benchmarks/bench_moe.py still runs (not timed here): every layout through the trainer, ep2 holding
    half the experts and reporting its dispatch + combine share, ZeRO-3 on it holding less again. The
    script's ``meshwise train gpt`` jobs run their command lines in this process (conftest.meshwise_here)."""
    out = tmp_path / "moe.json"
    spec = importlib.util.spec_from_file_location("bench_moe", BENCHMARKS / "bench_moe.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "subprocess", SimpleNamespace(run=lambda command, **_: meshwise_here(command)))
    args = ["--hidden", "32", "--seq-len", "8", "--batch", "2", "--backend", "gloo", "--rounds", "1"]
    args += ["--layouts", "dp2,ep2,zero3-ep2"]
    monkeypatch.setattr(sys, "argv", ["bench_moe.py", *args, "--steps", "2", "--json", str(out)])
    bench.main()
    rows = {row["layout"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"dp2", "ep2", "zero3-ep2"}
    assert all(row["tokens_per_second"] > 0 for row in rows.values())
    state = {name: row["state_bytes_per_rank"] for name, row in rows.items()}
    assert state["zero3-ep2"] < state["ep2"] < state["dp2"]
    assert 0 < rows["ep2"]["exchange_share"] < 1 and rows["dp2"]["exchange_share"] is None
    assert 0 < rows["zero3-ep2"]["exchange_share"] < 1


def test_checkpoints_resume_across_ep_sizes(tmp_path) -> None:
    """DCP by the plain model's names: ep2 → the whole model on each rank, and back, exactly. Each rank
    compares the names it saved; the whole models agreeing across ranks covers the other rank's experts."""
    for rank in spawn(checkpoint_across_ep, 2, (str(tmp_path),), timeout=110):
        for direction, result in rank.items():
            assert result["difference"] == 0.0 and result["ranks differ by"] == 0.0, (direction, result)
        whole = len(GPT(CONFIG).state_dict())
        assert rank["ep2->whole"]["names held"] == whole
        assert rank["whole->ep2"]["names compared"] == rank["whole->ep2"]["names held"] < whole
