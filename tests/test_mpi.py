"""The MPI track under a real ``mpirun``: the mpi backend, the MPI bootstrap, failures, ``meshwise pi``.

Each multi-rank test starts ``mpirun -n K`` as a subprocess in its own session (so a timeout kills every
rank), runs tests/mpi_job.py, and asserts on the ``VERDICT`` lines the ranks print. CI installs
``.[mpi]`` (mpi4py + the Open MPI wheel), so these run there; they skip only where mpirun or mpi4py is
truly absent.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from meshwise.comm.buffers import adjacent_span
from meshwise.runtime import mpi_bootstrap
from meshwise.runtime.env import LaunchEnvError
from meshwise.runtime.mpi_bootstrap import placement

MPIRUN = shutil.which("mpirun")
JOB = str(Path(__file__).with_name("mpi_job.py"))
needs_mpi = pytest.mark.skipif(
    MPIRUN is None or importlib.util.find_spec("mpi4py") is None,
    reason="mpirun or mpi4py is not installed (pip install 'meshwise[mpi]')",
)
#: variables of other launchers that must not leak into the mpirun job from the test's environment.
_LEAKS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def mpirun(
    n: int, *args: str, timeout: float = 100.0, export: dict[str, str] | None = None
) -> tuple[int, str, float]:
    """(exit code, stdout+stderr, seconds) of ``mpirun -n n python ARGS``; the whole job dies on timeout.

    The ranks see this process's environment without other launchers' variables, plus ``export``.
    """
    env = {k: v for k, v in os.environ.items() if k not in _LEAKS and not k.startswith(("OMPI_", "PMI"))}
    env.update(export or {})
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", str(n), sys.executable, *args]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"mpirun -n {n} {' '.join(args)} hung for {timeout:g} s:\n{output[-3000:]}")
    return proc.returncode, output, time.monotonic() - start


def verdicts(output: str) -> dict[int, dict]:
    found = [
        json.loads(line[len("VERDICT ") :]) for line in output.splitlines() if line.startswith("VERDICT ")
    ]
    return {v["rank"]: v for v in found}


# ---------------------------------------------------------------------------------- pure helpers
def test_placement_groups_ranks_by_host_for_any_mapping():
    block = ["a", "a", "b", "b"]
    assert [placement(block, r) for r in range(4)] == [(0, 2, 0), (1, 2, 0), (0, 2, 1), (1, 2, 1)]
    round_robin = ["a", "b", "a", "b", "a"]  # mpirun --map-by node: rank // local_size would be wrong
    assert [placement(round_robin, r) for r in range(5)] == [
        (0, 3, 0),
        (0, 2, 1),
        (1, 3, 0),
        (1, 2, 1),
        (2, 3, 0),
    ]


def test_rank_0_address_skips_loopback_and_says_what_to_export(monkeypatch):
    monkeypatch.setattr(mpi_bootstrap, "resolve_ipv4", lambda host: "10.1.2.3")
    assert mpi_bootstrap.routable_ipv4() == "10.1.2.3"
    monkeypatch.setattr(mpi_bootstrap, "resolve_ipv4", lambda host: "127.0.1.1")  # Debian's /etc/hosts
    monkeypatch.setattr(mpi_bootstrap, "_outbound_ipv4", lambda: "10.9.8.7")
    assert mpi_bootstrap.routable_ipv4() == "10.9.8.7"
    monkeypatch.setattr(mpi_bootstrap, "_outbound_ipv4", lambda: None)  # no route off the node
    with pytest.raises(LaunchEnvError, match="export MASTER_ADDR"):
        mpi_bootstrap.routable_ipv4()


def test_adjacent_slots_are_sent_as_one_buffer_without_copy():
    whole = torch.arange(10.0)
    span = adjacent_span(list(whole.split([3, 0, 7])))
    assert span is not None and span.data_ptr() == whole.data_ptr() and span.numel() == 10
    inner = adjacent_span(list(whole[2:8].chunk(3)))
    assert (
        inner is not None
        and inner.data_ptr() == whole[2:].data_ptr()
        and inner.tolist() == [2, 3, 4, 5, 6, 7]
    )
    assert adjacent_span([whole[:3], whole[4:6]]) is None  # a gap
    assert adjacent_span([whole[3:5], whole[:3]]) is None  # out of order
    assert adjacent_span([torch.zeros(2), torch.zeros(2)]) is None  # separate tensors


# ---------------------------------------------------------------------------------- under mpirun
@needs_mpi
@pytest.mark.slow
def test_collective_matrix_on_mpi_matches_gloo():
    code, output, _ = mpirun(3, JOB, "matrix")
    results = verdicts(output)
    assert code == 0 and sorted(results) == [0, 1, 2], output[-3000:]
    for rank, result in results.items():
        assert result["count"] == 0, f"rank {rank}: {result['failures']}"


@needs_mpi
@pytest.mark.slow
def test_subgroups_async_half_precision_and_size_mismatch():
    code, output, _ = mpirun(3, JOB, "extras")
    results = verdicts(output)
    assert code == 0 and sorted(results) == [0, 1, 2], output[-3000:]
    assert results[0]["even"] == [0, 2, 1 + 3] and results[2]["even"] == [1, 2, 4]
    assert results[1]["even"] is None
    for rank, result in results.items():
        assert result["reverse"] == [2 - rank, [2, 1, 0]]  # new rank = position in the list
        assert result["async"] == [True, 3.0, 3.0]
        assert "members called split with different rank lists" in result["split_mismatch"]
        mismatch = f"[rank {rank} · all_to_all] rank 0 sends 3 elements to rank 1"
        assert result["split_sizes"].startswith(mismatch)
        # bf16 summed in float32 and rounded once; bf16 additions in any order would give 2.0
        assert result["bf16"] == [2.015625] * 4
        assert "tag -1 is outside the MPI range" in result["errors"][0]
        assert "AVG is not defined for integer" in result["errors"][1]
        assert "must be distinct members" in result["errors"][2]
    shorter, longer = results[1]["mismatch"]
    assert shorter.startswith("[rank 1 · recv] received 12 bytes from rank 0 but the buffer holds 16")
    assert longer.startswith("[rank 1 · recv] a message was larger than the buffer posted for it")


@needs_mpi
@pytest.mark.slow
@pytest.mark.parametrize(
    "export",
    [{}, {"MASTER_ADDR": "127.0.0.1"}],  # an address chosen by the user (which network), the port by MPI
    ids=["nothing", "only-master-addr"],
)
def test_bootstrap_fills_in_the_rendezvous_over_mpi(export):
    code, output, _ = mpirun(2, JOB, "bootstrap", export=export)
    results = verdicts(output)
    assert code == 0 and sorted(results) == [0, 1], output[-3000:]
    local_ranks = set()
    for result in results.values():
        assert result["exported"] == sorted(export)
        assert result["launcher"] == "openmpi" and result["backend"] == "gloo"
        world, local_rank, local_world, node = result["world"]
        assert (world, local_world, node) == (2, 2, 0)
        local_ranks.add(local_rank)
        assert result["sum"] == 3.0
    assert local_ranks == {0, 1}


@needs_mpi
@pytest.mark.slow
def test_rank_leaving_early_is_a_timeout_naming_rank_and_operation():
    code, output, _ = mpirun(2, JOB, "early_exit")
    results = verdicts(output)
    assert code != 0 and results[1]["left"] is True, output[-3000:]
    assert results[0]["error"].startswith("[rank 0 · all_reduce] no progress within 3 s")
    assert 2.5 < results[0]["waited"] < 20


@needs_mpi
@pytest.mark.slow
def test_debug_mode_names_a_mismatch_on_the_mpi_backend():
    code, output, _ = mpirun(2, JOB, "debug")
    results = verdicts(output)
    assert code == 0 and sorted(results) == [0, 1], output[-3000:]
    for result in results.values():
        assert re.search(
            r"rank 0 called all_reduce\(float32\[3\], sum\) at \S*mpi_job.py:\d+ while rank 1 called "
            r"broadcast\(float32\[3\], root=0\) at \S*mpi_job.py:\d+ \(collective #\d+\)",
            result["error"],
        ), result["error"]
        assert result["waited"] < 10


@needs_mpi
@pytest.mark.slow
@pytest.mark.parametrize("how", ["raise", "exit"])
def test_failing_rank_ends_the_whole_job_at_once(how):
    code, output, elapsed = mpirun(2, JOB, "crash", how)
    assert code != 0
    assert elapsed < 50, "the survivor waited for its 60 s timeout instead of being stopped"
    assert verdicts(output) == {}  # rank 0 was stopped inside its all_reduce
    if how == "raise":
        assert "meshwise: rank 1 raised RuntimeError; aborting the MPI job" in output
        assert "RuntimeError: rank 1 fails on purpose" in output
    else:
        assert re.search(r"[Ee]xit code:?\s+5\b", output), output[-3000:]  # mpirun names the rank's code


@needs_mpi
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "mpi"])
def test_meshwise_pi_runs_under_mpirun(backend):
    code, output, _ = mpirun(3, "-m", "meshwise", "pi", "midpoint", "10000", "--backend", backend)
    assert code == 0, output[-3000:]
    assert sorted(line.split(" |")[0] for line in output.splitlines() if line.startswith("rank ")) == [
        "rank 0/3",
        "rank 1/3",
        "rank 2/3",
    ]
    assert "Computed PI    = 3.14159265" in output
    assert "Total bins     = 10000" in output
    assert "Wall time      = " in output


@needs_mpi
@pytest.mark.slow
def test_meshwise_bench_on_the_mpi_backend_under_mpirun():
    code, output, _ = mpirun(
        4, "-m", "meshwise", "bench", "all_reduce", "--backend", "mpi", "-b", "1K", "-e", "8K"
    )
    assert code == 0, output[-3000:]
    assert "4 ranks (openmpi)" in output and "backend mpi" in output
    assert "# Wrong elements       : 0 OK" in output
