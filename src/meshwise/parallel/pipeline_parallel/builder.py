"""One call from a GPT and a pp group to a ready executor, with every size checked before any compute."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from meshwise.comm.api import Communicator
from meshwise.models.gpt import GPT, GPTConfig
from meshwise.parallel.pipeline_parallel.executor import PipelineExecutor
from meshwise.parallel.pipeline_parallel.partition import (
    GPTChunk,
    check_layers,
    chunks_of_rank,
    partition,
    tied_parameters,
)
from meshwise.parallel.pipeline_parallel.schedules import build_schedule, validate


def validate_pipeline(
    config: GPTConfig, stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1
) -> None:
    """Every error a pipeline of these sizes would hit, raised up front with the fix in the message."""
    validate(schedule, stages, micro_batches, virtual_stages)
    check_layers(config.layers, stages * virtual_stages)


def pipeline_gpt(
    model: GPT,
    pp: Communicator,
    *,
    schedule: str = "1f1b",
    micro_batches: int,
    virtual_stages: int = 1,
    dp: Communicator | None = None,
    layers_per_chunk: Sequence[int] | None = None,
) -> tuple[PipelineExecutor, list[GPTChunk]]:
    """This rank's chunks of ``model`` and the executor that trains them.

    Every rank passes the same ``model`` (same seed): the chunks are cut from it, so the stages start from
    exactly the weights a one-process run would. Optimise the returned chunks' parameters.
    """
    stages = pp.world_size
    validate_pipeline(model.config, stages, micro_batches, schedule, virtual_stages)
    plan = build_schedule(schedule, stages, micro_batches, virtual_stages)
    local = chunks_of_rank(partition(model, stages, virtual_stages, layers_per_chunk), pp.rank, stages)
    executor = PipelineExecutor(
        local, plan, pp, GPTChunk.loss, dp=dp, tied=tied_parameters(local) if stages > 1 else ()
    )
    return executor, local


def micro_batches_of(batch: torch.Tensor, micro_batches: int) -> list[torch.Tensor]:
    """``batch`` cut into ``micro_batches`` equal pieces along dim 0 (equal, so that the mean of the
    micro-batch losses is the batch's loss)."""
    if batch.shape[0] % micro_batches:
        raise ValueError(
            f"a batch of {batch.shape[0]} sequences cannot be cut into {micro_batches} equal micro-batches: "
            f"choose a batch size that is a multiple of --micro-batches"
        )
    return list(batch.chunk(micro_batches))
