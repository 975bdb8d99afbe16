"""Start a training run: on the ranks a launcher started, or on ``-np`` local ranks spawned here."""

from __future__ import annotations

import math

from meshwise.runtime.deadline import job_deadline
from meshwise.runtime.on_ranks import run_on_ranks
from meshwise.train.config import TrainConfig
from meshwise.train.errors import TrainingError
from meshwise.train.loop import train_rank_main
from meshwise.train.report import TrainResult


def run_training(config: TrainConfig) -> TrainResult | None:
    """Validate ``config``, train, and return rank 0's result (None on the other launched ranks).

    Raises :class:`TrainingError` (rank 0's, which says the most) when the run had to stop.
    """
    config.validate()
    with job_deadline(config.timeout):
        outcome = run_on_ranks(train_rank_main, (config,), nproc=config.nproc, default=1, deadline=math.inf)
    if isinstance(outcome, TrainingError):
        raise outcome
    return outcome
