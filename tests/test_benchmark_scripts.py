"""The benchmark scripts behind benchmarks/RESULTS.md still run: tiny sweeps, real rank processes, JSON
checked.

They are not timed here (performance lives in the benchmarks themselves); these runs catch a script
that no longer matches the library it measures, and check that what it writes is complete and that the
compared backends agreed. bench_shm runs as a script (its rank 0 reports progress on its own stderr); the
others' ``main()`` run in this process, their ranks forked from the suite's rank server rather than from
a fresh interpreter's (which would first import torch twice: 5-8 s of each tiny run on 2 cores).
"""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def _main(monkeypatch: pytest.MonkeyPatch, capsys, script: str, *args: str) -> str:
    """``python benchmarks/SCRIPT ARGS`` as its ``main()`` in this process; what it printed to stdout."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as for a script: its directory first (for the ranks too)
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / script), *args])
    capsys.readouterr()
    assert importlib.import_module(script.removesuffix(".py")).main() in (None, 0)
    return capsys.readouterr().out


def test_bench_shm_writes_a_complete_comparison(tmp_path):
    out = tmp_path / "shm.json"
    done = _run(
        "bench_shm.py", "--np", "2", "--sizes", "4K,64K", "--collectives", "all_reduce,broadcast",
        "--budget", "0.02", "--rounds", "2", "--repeat", "2", "--pause", "0.1", "--json", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["collective"], r["bytes"]) for r in rows] == [
        ("all_reduce", 4096), ("all_reduce", 65536), ("broadcast", 4096), ("broadcast", 65536)
    ]  # fmt: skip
    assert all(r["wrong"] == 0 and r["gloo_seconds"] > 0 and r["shm_seconds"] > 0 for r in rows)
    first, broadcast = rows[0], rows[2]
    shares = first["percent_of_limit_runs"]
    assert len(shares) == 2 and all(x > 0 for x in first["memcpy_limit_busbw_runs"])
    assert min(shares) <= first["percent_of_limit"] <= max(shares)
    assert broadcast["percent_of_limit"] is None and len(broadcast["run_shm_seconds"]) == 2
    assert len(result["copy_bandwidth_samples"]) == 3 and result["repeat"] == 2  # before, after each run
    assert "all_reduce" in done.stdout and "memcpy-bound limit" in done.stdout
    # progress on stderr: a full sweep is otherwise silent for a quarter of an hour
    assert "# run 1/2, 2 ranks: 2 collectives x 2 sizes" in done.stderr and "# run 2/2" in done.stderr
    assert "2 ranks: all_reduce done (1/2)" in done.stderr and "broadcast done (2/2)" in done.stderr


def test_bench_algorithms_calibrates_then_compares(tmp_path, monkeypatch, capsys):
    cal, first, second = tmp_path / "cal.json", tmp_path / "sweep.json", tmp_path / "compare.json"
    common = ["-np", "2", "-b", "4096", "-e", "262144", "-f", "8", "-n", "3", "--rounds", "2"]
    _main(monkeypatch, capsys, "bench_algorithms.py", *common, "--calibrate", str(cal), "--json", str(first))
    text = _main(monkeypatch, capsys, "bench_algorithms.py", *common, "--calibration", str(cal), "--json",
                 str(second))  # fmt: skip
    saved = json.loads(cal.read_text())
    assert set(saved["by_world_size"]) == {"2"}
    assert set(saved["intra"]) == {"alpha", "beta", "gamma", "sigma", "delta"}
    rows = json.loads(second.read_text())["results"]
    assert [r["nbytes"] for r in rows] == [4096, 32768, 262144]
    for row in rows:
        assert set(row["seconds"]) == {"native", "ring", "rd", "rhd", "tree", "auto", "control"}
        assert all(t > 0 for t in row["seconds"].values()) and row["iters"] == 6
        assert row["auto_choice"] in row["seconds"] and row["predicted"]["auto"] > 0
    assert "cost model vs measured (2 ranks)" in text


def test_bench_gpt_compares_both_pairs_on_equal_models(tmp_path, monkeypatch, capsys):
    out = tmp_path / "gpt.json"
    text = _main(monkeypatch, capsys, "bench_gpt.py", "--config", "gpt-tiny", "--seq-len", "16", "--rounds",
                 "1", "--steps", "1", "--warmup", "1", "--json", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    assert result["one_process"]["max_logit_difference"] < 1e-5  # the plain-torch model is the same one
    assert result["two_ranks"]["max_weight_difference"] < 1e-5  # DDP and ours took the same steps
    assert len(result["ratios"]) == 4 and all(r > 0 for r in result["ratios"].values())
    assert "2 ranks: compute only / torch DDP on gloo" in result["ratios"]  # the floor is measured alongside
    phases = result["two_ranks"]["phases"]
    assert set(phases) == {"torch DDP/gloo", "ours/shm", "ours/shm, mid-backward", "compute only"}
    assert all(len(times) == 1 and times[0] > 0 for by in phases.values() for times in by.values())
    assert "torch DDP on gloo" in text and "rank 0 phases" in text


def test_bench_zero_compares_every_configuration_and_they_agree(tmp_path, monkeypatch, capsys):
    out = tmp_path / "zero.json"
    text = _main(monkeypatch, capsys, "bench_zero.py", "--config", "gpt-tiny", "--seq", "16", "--rounds",
                 "1", "--steps", "1", "--warmup", "0", "--json", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    names = {"fsdp2/gloo", "zero3/gloo", "zero3/shm", "ddp/gloo", "zero1/gloo", "zero2/gloo"}
    assert set(result["ratios"]) == names and set(result["memory"]) == names
    assert all(d < 1e-5 for d in result["max_weight_difference_vs_ddp"].values())
    kinds = ("parameters", "gradients", "optimizer_state")
    state = {n: sum(result["memory"][n][k] for k in kinds) for n in names}
    assert state["zero3/gloo"] == state["fsdp2/gloo"] < state["zero2/gloo"] < state["zero1/gloo"]
    assert state["zero1/gloo"] < state["ddp/gloo"]
    assert "zero3/shm" in text
