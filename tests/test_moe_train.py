"""``meshwise train gpt --experts``: a MoE GPT trains on one process and data parallel with the same losses,
prints its router report, and refuses what it cannot train before any rank starts (``--ep`` and its
compositions: tests/test_moe_ep_train.py)."""

from __future__ import annotations

import json
import re

import pytest

from meshwise.cli import main
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.resolve import resolve


def _argv(text: str, ranks: int, json_path: str) -> list[str]:
    # micro-batches of 2 sequences on both layouts: a capacity applies per forward pass, so one process
    # accumulating 4 of them drops exactly the tokens 2 ranks accumulating 2 each drop
    return [
        "train", "gpt", "-np", str(ranks), "--config", "gpt-moe-tiny", "--layers", "2", "--data", text,
        "--seq-len", "16", "--global-batch", "8", "--micro-batch", "2", "--steps", "2", "--eval-every", "1",
        "--eval-windows", "4", "--capacity-factor", "1.0", "--backend", "gloo", "--json", json_path,
    ]  # fmt: skip


def test_data_parallel_moe_matches_one_process_and_reports_the_router(text: str, tmp_path, capsys) -> None:
    """Loss at every step equal within 1e-5 (fp32, gradients summed in another order; see test_gpt_train),
    and on one process a router line after each log line whose counts add up: 2 layers × 8·16 tokens ×
    top-2 per step. (Router counts across layouts are compared exactly in tests/test_moe.py.)"""
    runs = {}
    for ranks in (1, 2):
        path = tmp_path / f"np{ranks}.json"
        assert main(_argv(text, ranks, str(path))) == 0
        runs[ranks] = json.loads(path.read_text())
        if ranks == 1:  # printed in this process (rank 0 of two ranks prints in its own)
            out = capsys.readouterr().out
    losses = {ranks: [step["loss"] for step in run["history"]] for ranks, run in runs.items()}
    assert len(losses[1]) == 2 and max(abs(a - b) for a, b in zip(*losses.values(), strict=True)) < 1e-5
    assert "mixture of experts: 4 experts per MLP, top-2, capacity factor 1" in out
    reports = re.findall(r"tokens min/mean/max (\d+)/([\d.]+)/(\d+) .* dropped (\d+)", out)
    assert len(reports) == 2  # one per log line
    per_line = 2 * 8 * 16 * 2  # one step since the last line: 2 layers, 8·16 tokens, top-2
    for low, mean, high, dropped in reports:
        assert float(mean) == per_line / (2 * 4) and int(low) <= float(mean) <= int(high)
        assert 0 <= int(dropped) < per_line


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"experts": 4, "top_k": 5}, r"--top-k 5 must be between 1 and the number of experts \(4\)"),
        ({"config": "gpt-moe-tiny", "capacity_factor": -1.0}, "--capacity-factor must be a positive number"),
        ({"top_k": 2}, "--top-k configure a mixture of experts: add --experts E"),
        ({"config": "gpt-moe-tiny", "init_from": "gpt2"}, "drop --init-from"),
        ({"experts": 4, "z_loss_coef": float("nan")}, "--z-loss-coef must be a number ≥ 0"),
    ],
)
def test_bad_moe_setting_is_one_clear_error(text: str, overrides: dict, message: str) -> None:
    settings = {"config": "gpt-tiny", "data": text, "seq_len": 16, "steps": 2}
    with pytest.raises(ValueError, match=message):
        resolve(GPTTrainConfig.from_flags(**(settings | overrides)))
