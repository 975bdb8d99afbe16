"""Start a training run: on the ranks a launcher started, or on ``-np`` local ranks spawned here."""

from __future__ import annotations

from meshwise.runtime.env import plan_ranks
from meshwise.runtime.spawn import spawn
from meshwise.train.config import TrainConfig
from meshwise.train.errors import TrainingError
from meshwise.train.loop import train_rank_main
from meshwise.train.report import TrainResult


def run_training(config: TrainConfig) -> TrainResult | None:
    """Validate ``config``, train, and return rank 0's result (None on the other launched ranks).

    Raises :class:`TrainingError` (rank 0's, which says the most) when the run had to stop.
    """
    config.validate()
    plan = plan_ranks(config.nproc, default=1)
    if plan.launched or plan.world_size == 1:
        results = [train_rank_main(config)]
    else:
        results = spawn(train_rank_main, plan.world_size, (config,), timeout=config.timeout)
    for outcome in results:
        if isinstance(outcome, TrainingError):
            raise outcome
    return results[0]
