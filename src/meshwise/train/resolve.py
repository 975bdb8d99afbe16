"""The one step of ``meshwise train mlp|deep-mlp|cnn`` that reads this machine: CUDA, the communicator,
the MNIST files, the checkpoint to resume. It runs once before any rank starts; each failure is one line
naming what to change."""

from __future__ import annotations

import torch

from meshwise.comm.factory import check_backend_here
from meshwise.data.mnist import find_mnist_files
from meshwise.train import checkpoint
from meshwise.train.config import TrainConfig


def resolve(config: TrainConfig) -> TrainConfig:
    """Validate ``config`` (pure), then check it against this machine; raise ValueError
    (FileNotFoundError for a missing path) naming the fix, or return it: the workloads need no fact from
    here beyond that it can run."""
    config.validate()
    mesh = config.mesh
    check_backend_here(mesh.backend, device=mesh.device, command=f"train {config.model}")
    if mesh.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available here; use --device cpu")
    if config.data.data_dir is not None:
        find_mnist_files(config.data.data_dir)  # the four files exist, before any rank starts
    _check_checkpoint(config)
    return config


def _check_checkpoint(config: TrainConfig) -> None:
    """A resumed run must find an intact checkpoint of this model with epochs left (a new run's directory
    is checked by :func:`resumed_directory`). Any world size and any ``--zero`` stage resumes it (DCP
    reshards)."""
    directory = checkpoint.resumed_directory(config.output.checkpoint, config.output.resume)
    if directory is None:
        return
    path = checkpoint.run_file(directory)
    run = checkpoint.read_train_run(directory)
    if run["model"] != config.model:
        raise ValueError(f"{path} holds a {run['model']!r} run, not {config.model!r}")
    checkpoint.check_resumable(directory, run["step"], path, "--epochs", run["epoch"], config.total_epochs)
    checkpoint.check_writable(directory)
