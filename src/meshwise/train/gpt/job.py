"""Start a GPT run: on the ranks a launcher started, or on ``-np`` local ranks spawned here."""

from __future__ import annotations

from meshwise.runtime.env import plan_ranks
from meshwise.runtime.spawn import spawn
from meshwise.train.gpt.config import GPTTrainConfig
from meshwise.train.gpt.loop import train_gpt_rank_main
from meshwise.train.gpt.report import GPTResult


def run_gpt_training(config: GPTTrainConfig) -> GPTResult | None:
    """Validate ``config`` (building the default corpus if needed), train, return rank 0's result."""
    config.validate()
    plan = plan_ranks(config.nproc, default=1)
    if plan.launched or plan.world_size == 1:
        return train_gpt_rank_main(config)
    return spawn(train_gpt_rank_main, plan.world_size, (config,), timeout=config.timeout)[0]
