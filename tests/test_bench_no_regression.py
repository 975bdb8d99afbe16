"""benchmarks/bench_no_regression.py: its ratio arithmetic, the recorded values it reads, and one tiny
side-by-side run against an older revision (not timed here: the benchmark itself is the measurement)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench_no_regression as bench  # noqa: E402


def test_ratios_pair_each_round_then_take_the_median_of_every_round() -> None:
    run = {"tp": {"dtensor/gloo": [2.0, 4.0], "meshwise/gloo": [1.0, 3.0], "meshwise/gloo+sp": [2.0, 2.0]}}
    other = {"tp": {"dtensor/gloo": [1.0], "meshwise/gloo": [0.9], "meshwise/gloo+sp": [1.5]}}
    per_run = bench.paired_ratios([run, other])
    assert set(per_run) == {"tp vs DTensor", "tp+sp vs DTensor"}  # groups not measured are left out
    assert per_run["tp vs DTensor"] == [[0.5, 0.75], [0.9]]
    assert bench.median_ratio(per_run["tp vs DTensor"]) == 0.75
    assert bench.median_ratio(per_run["tp+sp vs DTensor"]) == 1.0


def test_every_ratio_has_its_last_recorded_value() -> None:
    recorded = bench.recorded_ratios(BENCHMARKS / "results")
    assert set(recorded) == set(bench.RATIOS)
    assert all(value is not None and 0.2 < value < 5 for value in recorded.values()), recorded


@pytest.mark.slow
def test_a_run_measures_now_and_an_older_revision_side_by_side(tmp_path) -> None:
    out = tmp_path / "noregress.json"
    args = ["--groups", "pp-gpipe", "--before", "HEAD", "--rounds", "1", "--inner-rounds", "1",
            "--steps", "1", "--warmup", "0", "--json", str(out)]  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_no_regression.py"), *args],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert set(result["ratios"]) == {"now", "before"}
    for label in ("now", "before"):
        assert set(result["ratios"][label]) == {"pp gpipe m4 vs torch"}
        assert len(result["runs"][label]) == 1 and result["ratios"][label]["pp gpipe m4 vs torch"] > 0
    assert "at HEAD" in done.stdout and "pp gpipe m4 vs torch" in done.stdout
    assert done.stderr.index("1/1: now") < done.stderr.index("1/1: before")  # (the next round: reversed)


def test_an_unknown_revision_is_one_line() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_no_regression.py"), "--before", "no-such-rev"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0
    assert done.stderr.strip().startswith("--before no-such-rev: git archive failed")
