"""``meshwise train``: data-parallel training of the reference workloads, with checkpoints and resume."""

from meshwise.train.config import TrainConfig
from meshwise.train.errors import TrainingError
from meshwise.train.loop import run_training
from meshwise.train.report import EpochStats, TrainResult
from meshwise.train.workloads import WORKLOADS

__all__ = [
    "WORKLOADS",
    "EpochStats",
    "TrainConfig",
    "TrainResult",
    "TrainingError",
    "run_training",
]
