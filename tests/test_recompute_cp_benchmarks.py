"""benchmarks/bench_recompute.py and bench_context_parallel.py still run: tiny sizes, JSON checked.

Not timed here (performance lives in the benchmarks); the memory figures are exact functions of the
shapes, so they are checked.
"""

import json

import pytest

from test_benchmark_scripts import _run


@pytest.mark.slow
def test_bench_recompute_measures_every_mode_and_the_losses_agree(tmp_path):
    out = tmp_path / "recompute.json"
    text = _run("bench_recompute.py", "--config", "gpt-tiny", "--seq", "32", "--rounds", "1", "--warmup", "0",
                "--json", str(out)).stdout  # fmt: skip
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"dropout 0.0", "dropout 0.1"}
    for result in results.values():
        assert result["losses_equal"]
        assert all(abs(m["ratio"] - 1) < 0.02 for m in result["memory"].values())
        assert result["memory"]["full"]["measured"] < result["memory"]["selective"]["measured"]
    assert "within 10% of the formula in every mode: True" in text


@pytest.mark.slow
def test_bench_context_parallel_reports_memory_speed_and_budget(tmp_path):
    out = tmp_path / "cp.json"
    args = ["--config", "gpt-tiny", "--half", "16", "--rounds", "1", "--warmup", "0", "--json", str(out)]
    _run("bench_context_parallel.py", *args)
    result = json.loads(out.read_text())
    memory = result["memory"]
    one, cp2, cp4 = (memory[f"cp{cp} none 32"] for cp in (1, 2, 4))
    assert cp4 < cp2 <= 0.55 * one
    assert set(result["throughput"]["median"]) == {"cp2 at 2L", "dp2 at L"}
    longest = {name: row["longest"] for name, row in result["budget"].items()}
    assert longest["cp2 none"] > longest["cp1 none"] and longest["cp1 full"] > longest["cp1 none"]
