"""``meshwise train mlp|deep-mlp|cnn`` settings in sections (:mod:`meshwise.train.sections`); the
machine is read by :mod:`meshwise.train.resolve`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from meshwise.train.sections import (
    FlagSections,
    MeshSection,
    OutputSection,
    ProfileSection,
    at_least_one,
    check_seed,
)
from meshwise.train.workloads import WORKLOADS, Workload


@dataclass(frozen=True)
class SGDSection:
    """The workload's optimizer; ``lr`` None: the workload's default."""

    lr: float | None = None  # for one rank
    lr_scaling: bool = True  # multiply lr by the number of ranks


@dataclass(frozen=True)
class WorkloadDataSection:
    """The samples and their order; None: the workload's default (see :data:`WORKLOADS`)."""

    data_dir: str | None = None  # cnn only: a directory with MNIST IDX files
    epochs: int | None = None
    batch_size: int | None = None  # samples per rank per step
    seed: int = 0  # initial weights and shuffling


@dataclass(frozen=True)
class DebugProfileSection(ProfileSection):
    """The shared measurements, and the collective checks only these workloads offer."""

    debug: bool = False  # check every collective across ranks (meshwise.init(debug=True))


@dataclass(frozen=True)
class TrainConfig(FlagSections):
    """Everything a rank needs to train a workload. Build it with :meth:`from_flags` (``"mlp", zero=1``)."""

    model: str
    mesh: MeshSection = field(default_factory=MeshSection)
    optimizer: SGDSection = field(default_factory=SGDSection)
    data: WorkloadDataSection = field(default_factory=WorkloadDataSection)
    output: OutputSection = field(default_factory=OutputSection)
    profile: DebugProfileSection = field(default_factory=DebugProfileSection)

    @property
    def workload(self) -> Workload:
        return WORKLOADS[self.model]

    @property
    def total_epochs(self) -> int:
        return self.data.epochs if self.data.epochs is not None else self.workload.epochs

    @property
    def per_rank_batch(self) -> int:
        return self.data.batch_size if self.data.batch_size is not None else self.workload.batch_size

    @property
    def base_lr(self) -> float:
        return self.optimizer.lr if self.optimizer.lr is not None else self.workload.lr

    def validate(self) -> TrainConfig:
        """Raise ValueError saying what to change; return self. Pure: no file, no environment."""
        if self.model not in WORKLOADS:
            raise ValueError(f"unknown model {self.model!r}; choose one of {', '.join(WORKLOADS)}")
        self.mesh.check()
        at_least_one({"--epochs": self.total_epochs})
        if self.per_rank_batch < 1:
            raise ValueError(
                f"--batch-size must be a positive number of samples per rank, got {self.per_rank_batch}"
            )
        if not (math.isfinite(self.base_lr) and self.base_lr > 0):
            raise ValueError(f"--lr must be a positive number, got {self.base_lr}")
        check_seed(self.data.seed)
        if self.data.data_dir is not None and not self.workload.accepts_data_dir:
            raise ValueError(f"model {self.model!r} trains on synthetic data; --data is only for cnn")
        self.output.check()
        return self
