"""Work that cannot succeed is refused before it starts: MPI without an MPI launcher, more memory than
the machine has (issue 20, items 5 and 8)."""

from __future__ import annotations

import sys

import pytest

from meshwise.bench.busbw import layout_for
from meshwise.bench.cases import buffer_bytes
from meshwise.cli import build_parser, main
from meshwise.cli.bench import build_job
from meshwise.cli.pi import build_job as pi_build_job
from meshwise.runtime import memory
from meshwise.runtime.env import check_mpi_launch

LOCAL = {"PATH": "/usr/bin"}  # no launcher's variables
MPIRUN = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}  # fmt: skip


def test_mpi_is_accepted_only_under_an_mpi_launcher():
    check_mpi_launch("pi midpoint 1e6", MPIRUN)
    with pytest.raises(
        ValueError, match=r"needs ranks started by an MPI launcher.*`mpirun -np 4 meshwise pi"
    ):
        check_mpi_launch("pi midpoint 1e6", LOCAL)


@pytest.mark.parametrize(
    "argv",
    [
        ["pi", "midpoint", "1000", "--backend", "mpi"],
        ["pi", "montecarlo", "1000", "-np", "2", "--backend", "mpi"],
        ["train", "mlp", "--backend", "mpi"],
        ["bench", "all_reduce", "--backend", "mpi"],
    ],
)
def test_backend_mpi_without_mpirun_is_refused_before_mpi_starts(argv, capsys, monkeypatch):
    for name in [n for n in sys.modules if n.startswith("mpi4py")]:
        monkeypatch.delitem(sys.modules, name)  # so that the check below sees any new import
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--backend mpi needs ranks started by an MPI launcher" in err
    assert "mpi4py.MPI" not in sys.modules  # MPI was never initialised: no sm_segment files left behind


# ---------------------------------------------------------------------------------------------- memory
@pytest.fixture
def eight_gib(monkeypatch):
    """This machine has 8 GiB available, whatever the test host has."""
    monkeypatch.setattr(memory, "available_memory", lambda meminfo="/proc/meminfo": 8 * memory.GIB)


def test_the_machine_reports_its_available_memory(tmp_path):
    assert (memory.available_memory() or 0) > 0
    fake = tmp_path / "meminfo"
    fake.write_text("MemTotal:       24000000 kB\nMemAvailable:    2097152 kB\n")
    assert memory.available_memory(str(fake)) == 2 * memory.GIB
    with pytest.raises(
        ValueError, match=r"x needs about 3.0 GiB of memory, this machine has 2.0 GiB available; y"
    ):
        memory.check_memory(3 * memory.GIB, "x", "y", available=2 * memory.GIB)
    memory.check_memory(memory.GIB, "x", "y", available=2 * memory.GIB)


def test_bench_buffers_per_collective_are_plain_data():
    def size(collective, rank=0, root=0):
        return buffer_bytes(layout_for(collective, 4096, 4, 4), rank=rank, root=root)

    # out of place (the larger placement): separate input and output buffers
    assert size("all_reduce") == size("broadcast") == 8192
    assert size("all_gather") == size("reduce_scatter") == 4096 + 1024
    assert size("all_to_all") == size("sendrecv") == 8192
    assert size("gather", rank=0) == 4096 + 1024 and size("gather", rank=1) == 1024


@pytest.mark.parametrize(
    "argv,message",
    [
        (["bench", "all_reduce", "-b", "100G", "-e", "100G"], "-e 100G on 2 ranks needs about 600.0 GiB"),
        (
            ["bench", "all_to_all", "-e", "1G", "-np", "4", "--backend", "shm"],
            "-e 1G on 4 ranks needs about 12.0",
        ),
        (
            ["pi", "montecarlo", "1e11", "--chunk", "1e11", "--kernel", "eager"],
            "chunks of 100,000,000,000 items",
        ),
        (
            ["pi", "midpoint", "1e10", "-np", "2", "--chunk", "1e9", "--kernel", "eager"],
            "needs about 29.8 GiB",
        ),
    ],
)
def test_work_that_cannot_fit_is_refused_before_it_starts(argv, message, capsys, eight_gib):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "this machine has 8.0 GiB available" in err
    assert "lower -e" in err or "lower --chunk" in err


def test_work_that_fits_passes_the_memory_check(eight_gib):
    build_job(
        build_parser("bench").parse_args(
            ["bench", "all_to_all", "-e", "256M", "-np", "4", "--backend", "shm"]
        )
    )
    args = build_parser("pi").parse_args(
        ["pi", "montecarlo", "1e11", "--chunk", "1e6", "--kernel", "eager", "-np", "2"]
    )
    pi_build_job(args)
