"""Start a GPT run: on the ranks a launcher started, or on ``-np`` local ranks spawned here."""

from __future__ import annotations

import math

from meshwise.runtime.deadline import job_deadline
from meshwise.runtime.on_ranks import run_on_ranks
from meshwise.train.errors import TrainingError
from meshwise.train.gpt.config import GPTTrainConfig
from meshwise.train.gpt.loop import train_gpt_rank_main
from meshwise.train.gpt.report import GPTResult
from meshwise.train.gpt.resolve import resolve


def run_gpt_training(config: GPTTrainConfig) -> GPTResult | None:
    """Resolve ``config`` here (validating it, building the default corpus if needed), train, return rank
    0's result.

    Raises :class:`TrainingError` when the run had to stop (every rank raises it; rank 0's copy says so).
    """
    run = resolve(config)
    with job_deadline(config.mesh.timeout):  # the spawned ranks have none of their own: see job_deadline
        outcome = run_on_ranks(
            train_gpt_rank_main, (run,), nproc=config.mesh.nproc, default=1, deadline=math.inf
        )
    if isinstance(outcome, TrainingError):
        raise outcome
    return outcome
