"""Work that cannot succeed is refused before it starts: MPI without an MPI launcher, more memory than
the machine has (issue 20, items 5 and 8)."""

from __future__ import annotations

import sys

import pytest

from meshwise.cli import main
from meshwise.runtime.env import check_mpi_launch

LOCAL = {"PATH": "/usr/bin"}  # no launcher's variables
MPIRUN = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}  # fmt: skip


def test_mpi_is_accepted_only_under_an_mpi_launcher():
    check_mpi_launch("pi midpoint 1e6", MPIRUN)
    with pytest.raises(ValueError, match=r"needs ranks started by an MPI launcher.*`mpirun -np 4 meshwise pi"):
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
