"""One call from a GPT and a pp group to a ready executor, with every size checked before any compute."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from functools import partial

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
from meshwise.parallel.tensor_parallel import tensor_parallel, vocab_parallel_cross_entropy


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
    tp: Communicator | None = None,
    sequence_parallel: bool = False,
    layers_per_chunk: Sequence[int] | None = None,
) -> tuple[PipelineExecutor, list[GPTChunk]]:
    """This rank's chunks of ``model`` and the executor that trains them.

    Every rank passes the same ``model`` (same seed): the chunks are cut from it, so the stages start from
    exactly the weights a one-process run would. Optimise the returned chunks' parameters.

    With ``tp`` (this rank's tensor-parallel group, a stage's ranks) each stage is tensor parallel inside
    it: a copy of the model is sharded by :func:`tensor_parallel` first, then cut, so rank ``r`` of a
    stage's tp group exchanges activations with rank ``r`` of its neighbours' (its own ``pp`` group) —
    the replicated hidden states, or with ``sequence_parallel`` its shard of the sequence — and the last
    stage's loss is the vocabulary-parallel cross-entropy.
    """
    stages = pp.world_size
    validate_pipeline(model.config, stages, micro_batches, schedule, virtual_stages)
    plan = build_schedule(schedule, stages, micro_batches, virtual_stages)
    loss = GPTChunk.loss
    sharded = tp is not None and tp.world_size > 1
    if sharded:
        model = tensor_parallel(copy.deepcopy(model), tp, sequence_parallel=sequence_parallel)
        loss = partial(vocab_parallel_cross_entropy, comm=tp, vocab=model.config.vocab)
    elif sequence_parallel:
        raise ValueError("sequence parallelism splits the sequence across tensor-parallel ranks: pass tp")
    shards = tp.world_size if sharded and sequence_parallel else 1  # type: ignore[union-attr]
    cut = partition(model, stages, virtual_stages, layers_per_chunk, in_place=sharded, sequence_shards=shards)
    local = chunks_of_rank(cut, pp.rank, stages)
    tied = tied_parameters(local) if stages > 1 else ()
    executor = PipelineExecutor(local, plan, pp, loss, dp=dp, tied=tied)
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
