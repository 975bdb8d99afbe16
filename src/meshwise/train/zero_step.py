"""The ZeRO :class:`~meshwise.train.step.ParallelStep` (``--zero 1|2|3`` of ``meshwise train``): any
model sharded by :func:`~meshwise.parallel.zero.shard` over ``mesh.replicas``, whatever the model:

- the optimizer (the caller's factory) steps this rank's float32 master shards;
- the clipping norm is the whole model's, each flat group's shard counted by its
  :class:`~meshwise.parallel.placement.Placement` (:func:`flat_placements`);
- fp16 adds a :class:`~meshwise.parallel.zero.LossScaler`; a step whose gradient overflowed on any rank
  is skipped on every rank;
- checkpoints are the seam's one writer fed with the rectangles of this rank's flat ranges, under the
  plain model's names and shapes: a run resumes under any stage, as plain data parallelism, or on
  another number of ranks, while every rank writes and reads only its own elements.

What is model-specific arrives as :func:`~meshwise.parallel.zero.shard`'s options (the GPT's:
:func:`meshwise.train.gpt.parallelize.parallelize`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from meshwise.comm.mesh import GROUPINGS, Mesh
from meshwise.parallel.placement import Placement, clip_gradients_
from meshwise.parallel.state_dict import Held
from meshwise.parallel.tensor_parallel import shard_dim
from meshwise.parallel.zero import LossScaler, shard
from meshwise.parallel.zero.memory import rank_lines
from meshwise.parallel.zero.sharded import ShardedModel
from meshwise.parallel.zero.state_dict import zero_held
from meshwise.train.step import Batch, Local, OptimizerFactory, ParallelStep


class ZeroStep(ParallelStep):
    """This rank's master shards of ``local.model``, the optimizer over them, and (fp16) a loss scaler.

    ``options`` go to :func:`~meshwise.parallel.zero.shard` as they are. A model cut by tensor
    parallelism first arrives as this rank's shard, and ZeRO shards those shards further."""

    def __init__(
        self, local: Local, mesh: Mesh, optimizer: OptimizerFactory, stage: int, **options: Any
    ) -> None:
        super().__init__(mesh, next(local.model.parameters()).device)
        self.sharded = local
        self.model = shard(local.model, mesh.replicas, stage=stage, **options)
        self._shard_placements = flat_placements(self.model)
        self.optimizer = optimizer(self.model)
        # every rank skips together
        self.scaler = LossScaler(mesh.job) if options.get("mixed_precision") == "fp16" else None

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        loss = self.sharded.loss(self.model(inputs), targets, reduction)
        # what else joins the training gradient (not evaluation's sums)
        return self.sharded.training_loss(loss, self.model) if reduction == "mean" else loss

    def forward_backward(self, micro_batches: Sequence[Batch]) -> float:
        with self.timed_exchange(self.sharded.exchange_timer):
            return self.accumulate_gradients(
                micro_batches, self._loss, self.scaler.scale_loss if self.scaler else None
            )

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_flat_shards(self.model, self.scaler, self._shard_placements, max_norm, self.mesh)

    @torch.no_grad()
    def eval_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._loss(inputs, targets, reduction="sum")

    def memory_lines(self) -> list[str]:
        """Every rank's memory, accounted beside the ZeRO formula (collective: gathered to every rank)."""
        mixed = self.model.precision is not None
        return rank_lines(self.model, self.optimizer, k=8 + 4 * mixed)

    def summary_lines(self) -> list[str]:
        lines = [f"Memory (ZeRO-{self.model.stage}, per rank, accounted vs formula)"]
        lines += [f"  {line}" for line in self.memory_lines()]
        return lines + loss_scale_lines(self.scaler)

    def held(self) -> list[Held]:
        return zero_held(self.model, self.plain, self.mesh.coordinates["tp"], self._shard_placements)


def clip_flat_shards(
    zero: ShardedModel, scaler: LossScaler | None, placements: list[Placement], max_norm: float, mesh: Mesh
) -> float:
    """Clip ``zero``'s reduced gradient shards (each flat group's counted by its placement) by the whole
    model's norm and return it. Under fp16 first unscale them (in float32) and update the scale; when any
    rank of the scaler's group (the whole job) found an inf or nan, every rank discarded its gradients
    and returns inf: the optimizer then finds no gradient and the step is skipped together."""
    if scaler is not None:
        found_inf = scaler.unscale_(zero)
        scaler.update(found_inf)
        if found_inf:
            return math.inf
    shards = list(zip(zero.gradient_shards(), placements, strict=True))
    return clip_gradients_(shards, max_norm, mesh.coordinates, mesh.job)


def loss_scale_lines(scaler: LossScaler | None) -> list[str]:
    """The run summary's loss-scale line (fp16), empty otherwise."""
    if scaler is None:
        return []
    skipped = f"{scaler.skipped} step{'s' if scaler.skipped != 1 else ''} skipped for inf/nan gradients"
    return [f"Loss scale          = {scaler.scale:g} (fp16; {skipped})"]


def flat_placements(
    zero: ShardedModel, divided: frozenset[str] = frozenset(), tied: Mapping[str, str] | None = None
) -> list[Placement]:
    """Each flat group's placement: divided over the replicas ZeRO shards it over (``mesh.replicas``; an
    expert's ``mesh.expert_replicas`` and ep, whose ranks hold other experts), tp for tensor-parallel
    shards, and ``divided`` (a pipeline stage's pp); ``tied`` maps a group's first parameter to the one it
    is a copy of."""
    placements = []
    for group, names, expert in zip(zero.groups, zero.param_names, zero.replica_of, strict=True):
        axes = {*GROUPINGS["expert_replicas"], "ep"} if expert else set(GROUPINGS["replicas"])
        if shard_dim(group.params[0]) is not None:
            axes.add("tp")
        where = Placement(group.name, divided=frozenset(axes | divided), tied_to=(tied or {}).get(names[0]))
        placements.append(where)
    return placements
