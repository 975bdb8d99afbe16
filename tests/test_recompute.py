"""Activation recomputation (``--recompute``): the same numbers, less memory.

Recomputation re-runs forward code in backward with the random state replayed, so loss, every gradient and
every updated weight must equal the run without it *bit for bit* (the same operations on the same values
in the same order) — on one process and under every strategy of ``train gpt``. Dropout is on (0.1)
everywhere, so a mask drawn differently on the second run would show. The saved-bytes measurement is
checked against the per-layer formula of each mode.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import meshwise
from meshwise.cli import main
from meshwise.models.gpt import GPT, gpt_config, language_model_loss
from meshwise.parallel.protocols import recomputable_blocks
from meshwise.parallel.recompute import SavedBytes, apply_recompute, recomputed, saved_bytes
from meshwise.parallel.recompute.formulas import attention_keeps_scores, layer_saved_bytes, paper_layer_bytes
from meshwise.runtime.spawn import spawn
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.parallelize import parallelize
from meshwise.train.gpt.resolve import resolve

MODES = ("none", "selective", "full")
CONFIG = replace(gpt_config("gpt-tiny"), dropout=0.1)


def _one_process(mode: str, layers: int | None = None) -> tuple[float, dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    apply_recompute(recomputable_blocks(model), mode, layers)
    tokens = torch.randint(0, CONFIG.vocab, (3, 33), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    loss = language_model_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    after = torch.rand(4)  # the random stream continues as it would have without recomputation
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}, after


@pytest.mark.parametrize(("mode", "layers"), [("selective", None), ("full", None), ("full", 2)])
def test_one_process_bit_for_bit(mode: str, layers: int | None) -> None:
    loss, grads, after = _one_process("none")
    loss2, grads2, after2 = _one_process(mode, layers)
    assert loss2 == loss
    assert grads.keys() == grads2.keys()
    for name in grads:
        assert torch.equal(grads[name], grads2[name]), name
    assert torch.equal(after, after2)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_bf16_autocast_is_replayed(mode: str) -> None:
    """The recomputation runs under the autocast of the first run (else its matmuls would be fp32)."""

    def grads(recompute: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = GPT(CONFIG)
        apply_recompute(recomputable_blocks(model), recompute)
        tokens = torch.randint(0, CONFIG.vocab, (2, 33), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = language_model_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        return {name: p.grad for name, p in model.named_parameters()}

    plain, recomputed_grads = grads("none"), grads(mode)
    assert all(torch.equal(plain[name], recomputed_grads[name]) for name in plain)


def test_layers_choose_the_first_blocks_and_none_restores() -> None:
    model = GPT(CONFIG)
    blocks = recomputable_blocks(model)
    apply_recompute(blocks, "full", 2)
    assert [b.run_body is not None for b in blocks] == [True, True, False, False]
    apply_recompute(blocks, "selective")
    assert all(b.run_body is None and b.attn.run_core is not None for b in blocks)
    apply_recompute(blocks, "none")
    assert all(b.run_body is None and b.attn.run_core is None for b in blocks)


def test_bad_recompute_layers_named_before_any_work() -> None:
    blocks = recomputable_blocks(GPT(CONFIG))
    with pytest.raises(ValueError, match="larger than the 4 blocks of a stage"):
        apply_recompute(blocks, "full", 5)
    with pytest.raises(ValueError, match="add --recompute full"):
        apply_recompute(blocks, "selective", 1)


def test_recomputed_region_without_autograd_and_twice_with_a_retained_graph() -> None:
    x = torch.randn(5, requires_grad=True)
    with torch.no_grad():
        assert torch.equal(recomputed(torch.sin, x), torch.sin(x))
    y = recomputed(lambda t: torch.nn.functional.dropout(t.exp(), 0.5), x).sum()
    (first,) = torch.autograd.grad(y, x, retain_graph=True)
    (second,) = torch.autograd.grad(y, x)
    assert torch.equal(first, second)


def test_a_region_that_computes_something_else_the_second_time_is_named() -> None:
    calls = []

    def changing(t: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return t.exp() if len(calls) == 1 else t.exp().sin()

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="must compute the same thing"):
        recomputed(changing, x).sum().backward()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("mode", MODES)
def test_saved_bytes_per_layer_match_the_formula(mode: str, dropout: float) -> None:
    """Exact up to LayerNorm's per-token statistics (2 × 2 floats per token: < 1 % here)."""
    config = replace(CONFIG, dropout=dropout)
    model = GPT(config).train()
    apply_recompute(recomputable_blocks(model), mode)
    x = torch.randn(2, config.seq_len, config.hidden, requires_grad=True)
    measured = saved_bytes(model.blocks[0], x)
    mask = saved_bytes(torch.nn.Dropout(0.1), x) // x.numel()  # float on CPU, bool on CUDA
    formula = layer_saved_bytes(
        config.seq_len, 2, config.hidden, config.heads, mode=mode, value_bytes=4, mask_bytes=mask,
        dropout=dropout > 0, scores=attention_keeps_scores(dropout),
    )  # fmt: skip
    assert formula <= measured <= formula * 1.02


def test_paper_formulas() -> None:
    s, b, h, a, t = 1024, 4, 768, 12, 4
    sbh = s * b * h
    assert paper_layer_bytes(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert paper_layer_bytes(s, b, h, a, t=t) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert paper_layer_bytes(s, b, h, a, t=t, sp=True) == sbh / t * (34 + 5 * a * s / h)
    assert paper_layer_bytes(s, b, h, a, t=t, sp=True, mode="selective") == 34 * sbh / t
    assert paper_layer_bytes(s, b, h, a, mode="full") == 2 * sbh


def test_per_layer_scopes_count_each_call() -> None:
    model = GPT(CONFIG).train()
    measurement = SavedBytes(exclude=model.parameters())
    handles = measurement.per_layer([(f"block {i}", b) for i, b in enumerate(model.blocks)])
    tokens = torch.randint(0, CONFIG.vocab, (2, 32))
    with measurement.recording():
        for _ in range(2):  # two micro-batches: bytes are per call
            model(tokens)
    handles.remove()
    per = measurement.bytes_per_call()
    x = torch.randn(2, 32, CONFIG.hidden, requires_grad=True)
    assert per["block 1"] == saved_bytes(model.blocks[1], x)
    assert per["block 0"] == per["block 3"]


# ---------------------------------------------------------------- under every strategy (2 ranks; tp×pp 4)
STRATEGIES = {
    "dp2": {},
    "tp2+sp": {"tp": 2, "sp": True},
    "pp2": {"pp": 2, "micro_batch": 1},
    "pp2-zb": {"pp": 2, "micro_batch": 1, "schedule": "zb"},
    "tp2": {"tp": 2},
    "zero2": {"zero": 2},
    "zero3": {"zero": 3},
    "tp2-pp2": {"tp": 2, "pp": 2, "micro_batch": 1},
}


def _strategy_rank(flags: dict) -> dict[str, float]:
    """Every mode's loss, gradients, norm and updated weights on this rank, against mode none's."""
    config = GPTTrainConfig.from_flags(config="gpt-tiny", global_batch=4, seq_len=32, **flags)
    run = resolve(config)
    shape = run.shape
    world = meshwise.init("gloo", timeout=60, mesh=shape)
    try:
        dp, dp_rank = shape.dp, world.mesh.coordinates["dp"]
        tokens = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(5))
        mine = tokens.chunk(dp)[dp_rank]
        micro = config.per_rank_micro_batch(dp)
        batches = list(zip(mine[:, :-1].split(micro), mine[:, 1:].split(micro), strict=True))
        runs = {}
        for mode in MODES:
            torch.manual_seed(0)
            step = parallelize(
                GPT(replace(run.model_config, dropout=0.1)),
                world.mesh,
                resolve(config.with_flags(recompute=mode)),
            )
            assert all(b.run_body is not None for b in recomputable_blocks(step.model)) == (mode == "full")
            torch.manual_seed(7)
            loss = step.forward_backward(batches)
            grads = {n: p.grad.clone() for n, p in step.model.named_parameters() if p.grad is not None}
            norm = step.clip_grad_norm(0.0)
            step.optimizer.step()
            weights = {n: p.detach().clone() for n, p in step.model.named_parameters()}
            runs[mode] = (loss, norm, grads, weights)
        base = runs["none"]
        worst = {"grads": len(base[2])}
        for mode in ("selective", "full"):
            loss, norm, grads, weights = runs[mode]
            assert grads.keys() == base[2].keys() and weights.keys() == base[3].keys()
            worst[mode] = max(
                abs(loss - base[0]),
                abs(norm - base[1]),
                *((grads[n] - base[2][n]).abs().max().item() for n in grads),
                *((weights[n] - base[3][n]).abs().max().item() for n in weights),
            )
        return worst
    finally:
        meshwise.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_bit_for_bit_under_each_strategy(strategy: str) -> None:
    flags = STRATEGIES[strategy]
    ranks = max(2, flags.get("tp", 1) * flags.get("pp", 1))
    for rank in spawn(_strategy_rank, ranks, (flags,), timeout=110):
        assert rank["selective"] == 0.0 and rank["full"] == 0.0, rank
        if not strategy.startswith("zero"):  # ZeRO's gradients live in its flat shards until the step
            assert rank["grads"] > 0


# ---------------------------------------------------------------- the CLI
def test_profile_prints_each_blocks_saved_bytes_beside_the_formula(text, tmp_path, capsys) -> None:
    out = tmp_path / "run.json"
    argv = ["train", "gpt", "--config", "gpt-tiny", "--data", text, "--seq-len", "32", "--steps", "2"]
    argv += ["--global-batch", "4", "--eval-windows", "2", "--profile", "--json", str(out)]
    assert main([*argv, "--recompute", "full", "--recompute-layers", "1"]) == 0
    printed = capsys.readouterr().out
    assert "Activation memory saved for backward" in printed
    rows = json.loads(out.read_text())["profile"]["activation_memory"]
    assert [row["mode"] for row in rows] == ["full", "none", "none", "none"]
    assert all(1.0 <= row["measured"] / row["formula"] <= 1.02 for row in rows), rows
    assert rows[0]["measured"] == 4 * 32 * CONFIG.hidden * 4  # the block's input only, fp32


def test_recompute_layers_beyond_a_stage_refused_in_one_line(capsys) -> None:
    argv = ["train", "gpt", "--config", "gpt-tiny", "-np", "2", "--pp", "2", "--recompute", "full"]
    assert main([*argv, "--recompute-layers", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "larger than the 2 blocks of a stage" in err
