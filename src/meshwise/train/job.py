"""Start a training run: on the ranks a launcher started, or on ``-np`` local ranks spawned here."""

from __future__ import annotations

import math

from meshwise.runtime.deadline import job_deadline
from meshwise.runtime.on_ranks import run_on_ranks
from meshwise.train.config import TrainConfig
from meshwise.train.errors import TrainingError
from meshwise.train.loop import train_rank_main
from meshwise.train.report import TrainResult
from meshwise.train.resolve import resolve


def run_training(config: TrainConfig) -> TrainResult | None:
    """Resolve ``config`` here (validating it), train, and return rank 0's result (None on the other
    launched ranks).

    Raises :class:`TrainingError` (rank 0's, which says the most) when the run had to stop.
    """
    resolve(config)
    with job_deadline(config.mesh.timeout):
        outcome = run_on_ranks(
            train_rank_main, (config,), nproc=config.mesh.nproc, default=1, deadline=math.inf
        )
    if isinstance(outcome, TrainingError):
        raise outcome
    return outcome
