"""One call from a model, its plan and a pp group to a ready executor, every size checked before compute."""

from __future__ import annotations

import torch
from torch import nn

from meshwise.comm.api import Communicator
from meshwise.parallel.expert_parallel import ExpertReplicas
from meshwise.parallel.pipeline_parallel.executor import PipelineExecutor
from meshwise.parallel.pipeline_parallel.partition import (
    LayerChunk,
    check_layers,
    chunks_of_rank,
    partition,
    tied_parameters,
)
from meshwise.parallel.pipeline_parallel.schedules import build_schedule
from meshwise.parallel.plan import Loss, ParallelPlan


def validate_pipeline(
    layers: int, stages: int, micro_batches: int, schedule: str, virtual_stages: int = 1
) -> None:
    """Every error a pipeline of these sizes over ``layers`` layers would hit, raised up front with the fix
    in the message."""
    build_schedule(schedule, stages, micro_batches, virtual_stages)
    check_layers(layers, stages * virtual_stages)


def build_pipeline(
    model: nn.Module,
    plan: ParallelPlan,
    pp: Communicator,
    *,
    schedule: str = "1f1b",
    micro_batches: int,
    virtual_stages: int = 1,
    dp: Communicator | None = None,
    experts: ExpertReplicas | None = None,
    loss: Loss | None = None,
    sequence_shards: int = 1,
    in_place: bool = False,
    activation_dtype: torch.dtype = torch.float32,
) -> tuple[PipelineExecutor, list[LayerChunk]]:
    """This rank's chunks of ``model`` and the executor that trains them.

    Every rank passes the same ``model`` (same seed): the chunks are cut from it, so the stages start from
    exactly the weights a one-process run would. Optimise the returned chunks' parameters. ``loss``
    defaults to the plan's. ``dp`` averages the stages' gradients over their replicas; with experts spread
    over ep (``dp`` then the dp·ep·cp ranks with the same dense weights) ``experts`` says where the expert
    parameters' average instead.

    A tensor-parallel stage is a model already converted to this rank's shard (``in_place=True``: its
    layers hold a communicator that must not be copied), with the sharded loss; rank ``r`` of a stage's tp
    group then exchanges activations with rank ``r`` of its neighbours' (its own ``pp`` group) — the
    replicated hidden states, or under sequence parallelism (``sequence_shards`` = tp) its shard of the
    sequence. ``activation_dtype``: what activations and their gradients travel (and arrive) in between
    stages — float16 for stages that compute in float16 (ZeRO's fp16 compute copies), so that a stage's
    input is in its weights' dtype.
    """
    stages = pp.world_size
    # the schedule and the cut check every size before any compute (and before the model's copy)
    steps = build_schedule(schedule, stages, micro_batches, virtual_stages)
    cut = partition(model, plan, stages, virtual_stages, in_place=in_place, sequence_shards=sequence_shards)
    local = chunks_of_rank(cut, pp.rank, stages)
    tied = tied_parameters(local)
    loss = plan.loss if loss is None else loss
    executor = PipelineExecutor(
        local, steps, pp, loss, dp=dp, experts=experts, tied=tied, dtype=activation_dtype
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
