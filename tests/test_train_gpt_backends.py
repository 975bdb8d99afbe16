"""``train gpt`` refuses a backend that cannot run here before any rank starts (issue 30.5)."""

from __future__ import annotations

from gpt_cli import gpt_argv, one_line, refuse_ranks
from meshwise.cli import main


def test_nccl_without_cuda_is_refused_up_front(text, capsys, monkeypatch):
    refuse_ranks(monkeypatch)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(gpt_argv(text, "--steps", "2", "-np", "2", backend="nccl")) == 2
    assert "--backend nccl" in one_line(capsys.readouterr().err)


def test_mpi_outside_an_mpi_launcher_is_refused_up_front(text, capsys, monkeypatch):
    refuse_ranks(monkeypatch)
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert main(gpt_argv(text, "--steps", "2", "-np", "2", backend="mpi")) == 2
    assert "--backend mpi needs ranks started by an MPI launcher" in one_line(capsys.readouterr().err)
