"""A training run's settings, checked completely before any rank starts."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from meshwise.comm.factory import check_backend_here
from meshwise.data.mnist import find_mnist_files
from meshwise.runtime.timeouts import wait_timeout
from meshwise.train.checkpoint import check_writable, checkpoint_directory, read_train_run, run_file, step_dir
from meshwise.train.checkpoint_check import check_dcp_checkpoint
from meshwise.train.workloads import WORKLOADS, Workload

#: ``--zero`` stages: 0 is plain data parallelism (DataParallel), 1/2/3 shard optimizer state / + gradients
#: / + parameters (meshwise.parallel.zero), as ``train gpt --zero`` spells them.
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class TrainConfig:
    """Everything a rank needs to train; ``None`` for epochs, batch size or lr means the workload's
    default (see :data:`~meshwise.train.workloads.WORKLOADS`)."""

    model: str
    nproc: int | None = None
    epochs: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    lr_scaling: bool = True
    seed: int = 0
    backend: str = "auto"
    device: str | None = None
    checkpoint: str | None = None
    resume: bool = False
    data_dir: str | None = None
    timeout: float | None = None  # a deadline for the whole job (None: none); waits time out anyway
    profile: bool = False  # time each step's phases and print the breakdown with a verdict
    trace: str | None = None  # write a Chrome/Perfetto trace of the profiled steps (implies profile)
    debug: bool = False  # check every collective across ranks (meshwise.init(debug=True))
    zero: int = 0  # ZeRO stage; 0: DataParallel

    @property
    def workload(self) -> Workload:
        return WORKLOADS[self.model]

    @property
    def total_epochs(self) -> int:
        return self.epochs if self.epochs is not None else self.workload.epochs

    @property
    def per_rank_batch(self) -> int:
        return self.batch_size if self.batch_size is not None else self.workload.batch_size

    @property
    def base_lr(self) -> float:
        return self.lr if self.lr is not None else self.workload.lr

    @property
    def comm_timeout(self) -> float:
        """Each wait's bound; ``timeout`` bounds the whole job."""
        return wait_timeout(self.timeout)

    def validate(self) -> TrainConfig:
        """Raise ValueError (FileNotFoundError for missing paths) saying what to change; return self."""
        if self.model not in WORKLOADS:
            raise ValueError(f"unknown model {self.model!r}; choose one of {', '.join(WORKLOADS)}")
        if self.nproc is not None and self.nproc < 1:
            raise ValueError(f"-np must be at least 1, got {self.nproc}")
        if self.total_epochs < 1:
            raise ValueError(f"--epochs must be at least 1, got {self.total_epochs}")
        if self.per_rank_batch < 1:
            raise ValueError(
                f"--batch-size must be a positive number of samples per rank, got {self.per_rank_batch}"
            )
        if not (math.isfinite(self.base_lr) and self.base_lr > 0):
            raise ValueError(f"--lr must be a positive number, got {self.base_lr}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed must be in 0 .. 2**63-1, got {self.seed}")
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"--timeout must be positive seconds, got {self.timeout}")
        check_backend_here(self.backend, device=self.device, command=f"train {self.model}")
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"--zero must be 0, 1, 2 or 3 (the ZeRO stage), got {self.zero}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but CUDA is not available here; use --device cpu")
        if self.data_dir is not None:
            if not self.workload.accepts_data_dir:
                raise ValueError(f"model {self.model!r} trains on synthetic data; --data is only for cnn")
            find_mnist_files(self.data_dir)  # the four files exist, before any rank starts
        self._check_checkpoint()
        return self

    def _check_checkpoint(self) -> None:
        """A new run must not overwrite a checkpoint; a resumed one must find an intact checkpoint of this
        model with epochs left. Any world size and any ``--zero`` stage resumes it (DCP reshards)."""
        directory = checkpoint_directory(self.checkpoint, self.resume)
        if directory is None:
            return
        path = run_file(directory)
        if not self.resume:
            if path.exists():
                raise ValueError(
                    f"{path} already exists; pass --resume to continue that run, "
                    "or choose another --checkpoint"
                )
            check_writable(directory)
            return
        run = read_train_run(directory)
        if run["model"] != self.model:
            raise ValueError(f"{path} holds a {run['model']!r} run, not {self.model!r}")
        if run["epoch"] >= self.total_epochs:
            raise ValueError(
                f"{path} has already completed {run['epoch']} of --epochs {self.total_epochs}; "
                "pass a larger --epochs to train further"
            )
        check_dcp_checkpoint(step_dir(directory, run["step"]))  # intact, read without building tensors
        check_writable(directory)
