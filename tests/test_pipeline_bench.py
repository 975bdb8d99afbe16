"""benchmarks/bench_pipeline.py still runs against torch.distributed.pipelining; its JSON is complete."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_pipeline.py"


# one subprocess that spawns two ranks and imports torch's pipelining: slow on a busy machine
@pytest.mark.timeout(170)
def test_bench_pipeline_writes_every_contender(tmp_path):
    out = tmp_path / "pipeline.json"
    args = ["--schedules", "1f1b,interleaved", "--warmup", "0", "--micro-batches", "2"]
    args += ["--rounds", "1", "--steps", "1"]
    timelines = tmp_path / "timelines"  # created by the benchmark
    args += ["--overhead", "--json", str(out), "--timeline-dir", str(timelines)]
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=160)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {(r["schedule"], r["contender"]) for r in rows} == {
        (s, c) for s in ("1f1b", "interleaved") for c in ("meshwise/gloo", "meshwise/shm", "torch/gloo")
    }
    assert all(r["step_ms"] > 0 and r["stage0_peak_activation_bytes"] > 0 for r in rows)
    ours = [r for r in rows if r["contender"] == "meshwise/gloo"]
    theory = {"1f1b": 1 / 3, "interleaved": 1 / 5}  # (p − 1)/(v·m + p − 1), p = m = 2
    assert all(0 <= r["bubble_measured"] < 1 and r["bubble_theory"] == theory[r["schedule"]] for r in ours)
    assert all(0 <= r["bubble_replayed"] <= r["bubble_measured"] + 1e-9 for r in ours)
    assert all(r["hop_us"] > 0 and r["floor_vs_torch"] > 0 for r in ours)
    theirs = [r for r in rows if r["contender"] == "torch/gloo"]
    assert all(0 <= r["bubble_measured"] < 1 for r in theirs)  # torch's stage timed the same way
    assert all(r["max_weight_diff_vs_torch"] < 1e-6 for r in rows)  # the same model trained
    assert (timelines / "pipeline_1f1b_m2.png").exists() and (timelines / "pipeline_1f1b_m2.json").exists()
    assert json.loads(out.read_text())["config"]["hidden"] == 16  # --overhead's model
    assert "torch/gloo" in done.stdout
