"""Evaluation with fewer validation windows than data-parallel ranks, or shares that fill a different
number of batches, must not leave a rank waiting: a ZeRO-3 forward gathers parameters over the dp ranks,
so every rank runs as many forwards as the busiest (``train gpt --zero 3 --eval-windows 1 -np 2`` hung)."""

from __future__ import annotations

import json

import pytest

from gpt_cli import gpt_argv
from meshwise.cli import main


def _initial_val_loss(text: str, tmp_path, name: str, *extra: str) -> float:
    summary = tmp_path / f"{name}.json"
    # --timeout: before the fix the ranks waited on each other; the deadline turns that into exit 124
    argv = gpt_argv(text, "--steps", "1", "--timeout", "60", "--json", str(summary), *extra)
    assert main(argv) == 0
    return json.loads(summary.read_text())["initial_val_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("windows", ["1", "5"])  # 1: rank 1 has none; 5: 3 + 2 windows, 2 + 1 batches of 2
def test_zero3_evaluates_uneven_windows_in_lockstep_and_matches_one_rank(text, tmp_path, windows):
    sharded = _initial_val_loss(text, tmp_path, "zero3", "-np", "2", "--zero", "3", "--eval-windows", windows)
    reference = _initial_val_loss(text, tmp_path, "one", "-np", "1", "--eval-windows", windows)
    # the same weights and windows; only the float32 forward's batch shapes differ (rounding ~1e-7)
    assert sharded == pytest.approx(reference, rel=1e-5)
