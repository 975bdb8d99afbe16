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


@pytest.fixture
def two_gpus(monkeypatch):
    """Two visible CUDA devices with 80 and 20 GiB free (no GPU needed); records the devices asked."""
    import torch

    free = {0: 80 * memory.GIB, 1: 20 * memory.GIB}
    asked: list[int] = []

    def mem_get_info(index):
        asked.append(index)
        return free[index], 80 * memory.GIB

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    return asked


def _bench_job(*argv: str):
    return build_job(build_parser("bench").parse_args(["bench", *argv]))


def test_nccl_sweeps_are_checked_against_each_gpus_free_memory(two_gpus, capsys, eight_gib):
    # all_reduce of 16 GiB: 32 GiB of buffers per rank + NCCL's reserve fits cuda:0 (80 GiB free), not
    # cuda:1 (20 GiB); the host's 8 GiB do not matter to nccl
    assert main(["bench", "all_reduce", "-b", "16G", "-e", "16G", "-np", "2", "--backend", "nccl"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "-e 16G on 2 ranks needs about 32.5 GiB on each GPU, cuda:1 has 20.0 GiB free; lower -e" in err
    assert sorted(two_gpus) == [0, 1]
    two_gpus.clear()
    _bench_job("all_reduce", "-e", "9G", "-np", "2", "--backend", "nccl")  # 18.5 GiB fits both
    # gather's root holds its slot and the whole S: 4 + 16 GiB (+ 0.5) > 20 GiB
    with pytest.raises(ValueError, match=r"needs about 20\.5 GiB on each GPU"):
        _bench_job("gather", "-e", "16G", "-np", "4", "--backend", "nccl", "-r", "0")


def test_a_launched_rank_checks_its_own_gpu_only(two_gpus, monkeypatch, eight_gib):
    torchrun = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"cuda:1 has 20\.0 GiB free"):
        _bench_job("all_reduce", "-e", "16G", "--backend", "nccl")
    assert two_gpus == [1]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    two_gpus.clear()
    _bench_job("all_reduce", "-e", "16G", "--backend", "nccl")
    assert two_gpus == [0]


def test_free_device_memory_is_checked_against_the_fullest_gpu():
    memory.check_device_memory(3 * memory.GIB, {0: 4 * memory.GIB, 1: 3 * memory.GIB}, "x", "y")
    with pytest.raises(ValueError, match=r"x needs about 3.0 GiB on each GPU, cuda:2 has 2.0 GiB free; y"):
        memory.check_device_memory(3 * memory.GIB, {0: 4 * memory.GIB, 2: 2 * memory.GIB}, "x", "y")
