"""How a GPT run splits its batch into micro-batches when the user does not say (no processes)."""

from __future__ import annotations

import pytest

from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.config import default_pipeline_micro_batches
from meshwise.train.gpt.resolve import resolve


@pytest.mark.parametrize(
    ("per_rank", "pp", "schedule", "expected"),
    [
        (8, 2, "1f1b", 8),  # up to 4·p: the bubble (p−1)/(m+p−1) = 1/9 instead of m = 1's 1/2
        (64, 2, "gpipe", 8),  # capped at 4·p
        (100, 2, "1f1b", 5),  # the largest divisor under the cap
        (6, 4, "zb", 6),  # a batch smaller than 4·p: every sequence its own micro-batch
        (12, 3, "interleaved", 12),  # interleaving needs a multiple of p
        (8, 3, "interleaved", 1),  # none exists: 1, which validation then explains
        (7, 2, "1f1b", 7),
    ],
)
def test_default_pipeline_micro_batches(per_rank: int, pp: int, schedule: str, expected: int) -> None:
    assert default_pipeline_micro_batches(per_rank, pp, schedule) == expected


def test_a_pipeline_splits_its_batch_and_data_parallelism_does_not() -> None:
    assert GPTTrainConfig.from_flags(pp=2, global_batch=8).accumulation(dp=1) == 8
    assert GPTTrainConfig.from_flags(pp=2, global_batch=16).accumulation(dp=2) == 8
    assert (
        GPTTrainConfig.from_flags(global_batch=8).accumulation(dp=2) == 1
    )  # no pipeline: no accumulation by default
    # what the user asks for wins
    assert GPTTrainConfig.from_flags(pp=2, global_batch=8, micro_batches=2).accumulation(dp=1) == 2
    assert GPTTrainConfig.from_flags(pp=2, global_batch=8, micro_batch=4).accumulation(dp=1) == 2


def test_interleaved_without_a_fitting_default_is_refused_with_the_fix() -> None:
    config = GPTTrainConfig.from_flags(
        nproc=3, pp=3, global_batch=8, schedule="interleaved", virtual_stages=2, layers=6
    )
    with pytest.raises(ValueError, match="multiple of --pp 3"):
        resolve(config)
