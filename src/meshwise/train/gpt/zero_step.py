"""``meshwise train gpt --zero 1|2|3``: ZeRO sharded data parallelism over ``mesh.replicas`` (dp, and
the cp ranks, which hold the same weights).

The model is wrapped by :func:`~meshwise.parallel.zero.shard` (stage 3's units: the GPT blocks). What the
seam's contract asks of a sharded strategy, and how it is met here:

- AdamW with the data-parallel path's parameter groups (decay on matrices and embeddings, none on biases
  and LayerNorm gains): ``shard(separate_by=...)`` never puts the two kinds in one flat group, so each
  master shard belongs to exactly one optimizer group and the update is the plain model's, element for
  element — no per-element mask needed;
- the gradient norm for clipping is the whole model's (squares of every rank's shard, all-reduced);
- ``--dtype bf16`` computes with bf16 copies of float32 master shards (gathers and gradients in bf16);
  ``--dtype fp16`` does the same in float16 with a :class:`~meshwise.parallel.zero.LossScaler`: the loss
  is scaled before backward, the shards unscaled in float32 before clipping, and a step whose gradient
  overflowed on any rank is skipped on every rank (the loop's ``optimizer.step()`` then finds no gradient);
- checkpoints are the seam's one writer (:meth:`~meshwise.train.gpt.parallelize.ParallelStep.state_dict`)
  fed with the rectangles of this rank's flat ranges (:meth:`ZeroStep.held`): the plain model's names and
  shapes, so a run resumes under any stage, as plain data parallelism, or on another number of ranks,
  while every rank writes and reads only its own elements (never a whole tensor, never padding);
- ``full_model()`` is the seam's gather of the same rectangles (collective: every rank calls it).

With ``--ep`` (a mixture of experts whose experts are spread over ep ranks) two kinds of weights are
replicated over different ranks: the dense ones over ``mesh.replicas`` (dp·ep·cp), a rank's E/ep experts
only over ``mesh.expert_replicas`` (dp·cp). ZeRO shards each kind over its own ranks
(:func:`expert_replicas`, a :class:`~meshwise.parallel.zero.replicas.ReplicaGroup`): expert flat groups
reduce-scatter and all-gather over dp·cp, their averaged gradient divided by ep (as
:class:`~meshwise.parallel.expert_parallel.ExpertDataParallel` does), the optimizer steps on each kind's
shards, the global norm counts every expert once (an expert shard is divided over dp·cp and ep), and the
checkpoint holds each expert under its plain name (its global index) in the pieces of its dp·cp ranks, so
it resumes as plain ``--ep``, another stage, or one process. Not yet with ``--pp``: the pipeline's
stage ZeRO shards over one group (refused before launch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from meshwise.comm.mesh import GROUPINGS, Mesh
from meshwise.models.moe import with_auxiliary_losses
from meshwise.parallel.expert_parallel import is_expert_parameter
from meshwise.parallel.placement import Placement, clip_gradients_, place
from meshwise.parallel.state_dict import Held
from meshwise.parallel.tensor_parallel import shard_dim
from meshwise.parallel.zero import LossScaler, shard
from meshwise.parallel.zero.memory import rank_lines
from meshwise.parallel.zero.replicas import ReplicaGroup
from meshwise.parallel.zero.sharded import ShardedModel
from meshwise.parallel.zero.state_dict import zero_held
from meshwise.train.gpt.config import GPTTrainConfig
from meshwise.train.gpt.optimizer import adamw, decays
from meshwise.train.gpt.parallelize import Batch, LayerSharded, ParallelStep

#: The axes ZeRO shards over: ``mesh.replicas``, the ranks holding the same weights (dp, and cp whose
#: ranks see other tokens of the same sequences).
REPLICAS = frozenset(GROUPINGS["replicas"])
#: The axes an expert's flat shards are divided over: ZeRO's (``mesh.expert_replicas``, dp·cp) and ep,
#: whose ranks hold other experts.
EXPERT_SHARDS = frozenset(GROUPINGS["expert_replicas"]) | {"ep"}
#: --dtype → shard()'s mixed precision (float32 master shards in every case).
PRECISION = {"fp32": None, "bf16": "bf16", "fp16": "fp16"}


def tensor_parallel_key(name: str, param: nn.Parameter) -> tuple[bool, bool]:
    """ZeRO's flat groups never mix kinds the step treats apart: AdamW's decayed and undecayed
    parameters, and tensor-parallel shards and parameters replicated over tp (a group's gradient shard
    then has one placement, so the global norm counts it exactly once)."""
    return decays(name, param), shard_dim(param) is not None


class ZeroStep(ParallelStep):
    """This rank's master shards, AdamW over them, and (fp16) a loss scaler.

    With ``--tp`` the model is first cut into this rank's tensor-parallel shard (the order
    :func:`~meshwise.train.gpt.parallelize.parallelize` documents: TP, then data parallelism over dp), and
    ZeRO shards those shards over ``mesh.replicas`` (``mesh.dp`` unless ``--cp``): each (dp, tp) rank
    holds 1/(dp·tp) of every tp-sharded weight and 1/dp of the replicated ones — the layout of Megatron's
    distributed optimizer, or FSDP2 over DTensor TP with the flat range in place of FSDP2's dim-0 chunk.
    Flat groups keep tp shards and tp-replicated parameters apart (:func:`tensor_parallel_key`), so each
    gradient shard has one :class:`~meshwise.parallel.placement.Placement` and the global norm is the
    generic one.
    """

    def __init__(self, sharded: LayerSharded, mesh: Mesh, config: GPTTrainConfig) -> None:
        model = sharded.model
        super().__init__(config, mesh, next(model.parameters()).device)
        self.config, self.plan, self.tp = model.config, sharded.plan, sharded.tp
        self.sharded_loss, self.exchange_timer = sharded.loss, sharded.exchange_timer
        self.ep = mesh.ep.world_size
        self.model = shard(
            model,
            mesh.replicas,
            stage=config.mesh.zero,
            mixed_precision=PRECISION[config.model.dtype],
            separate_by=tensor_parallel_key,
            units=self.plan.layer_modules(model) if config.mesh.zero == 3 else None,
            replica_groups=expert_replicas(mesh),
        )
        self._shard_placements = [
            Placement(group.name, divided=shard_axes(group.params[0], expert=replicas > 0))
            for group, replicas in zip(self.model.groups, self.model.replica_of, strict=True)
        ]
        decayed = self.model.parameters_where(decays)
        self.optimizer = adamw(
            decayed, self.model.parameters_where(lambda n, p: not decays(n, p)), config.optimizer
        )
        # every rank skips together
        self.scaler = LossScaler(mesh.job) if config.model.dtype == "fp16" else None

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        loss = self.sharded_loss(self.model(inputs), targets, reduction)
        # a MoE model's load-balancing and z-losses join the training gradient (not evaluation's sums)
        return with_auxiliary_losses(loss, self.model) if reduction == "mean" else loss

    def forward_backward(self, micro_batches: Sequence[Batch]) -> float:
        with self.timed_exchange(self.exchange_timer):
            return self.accumulate_gradients(
                micro_batches, self._loss, self.scaler.scale_loss if self.scaler else None
            )

    def clip_grad_norm(self, max_norm: float) -> float:
        if skipped_for_overflow(self.scaler, self.model):
            return math.inf  # skipped: the optimizer finds no gradient
        shards = list(zip(self.model.gradient_shards(), self._shard_placements, strict=True))
        return clip_gradients_(shards, max_norm, self.mesh.coordinates, self.mesh.job)

    @torch.no_grad()
    def eval_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._loss(inputs, targets, reduction="sum")

    def summary_lines(self) -> list[str]:
        """The per-rank memory report beside the ZeRO formula, and (fp16) the loss scale."""
        mixed = self.model.precision is not None
        lines = [f"Memory (ZeRO-{self.model.stage}, per rank, accounted vs formula)"]
        lines += [f"  {line}" for line in rank_lines(self.model, self.optimizer, k=8 + 4 * mixed)]
        return lines + loss_scale_lines(self.scaler)

    def held(self) -> list[Held]:
        """The rectangles of this rank's flat ranges, tp shards placed at this tp rank's slice."""
        placements = place(self.model.module.named_parameters())  # each parameter's tp cut
        return zero_held(
            self.model, self.plain, placements, self.mesh.coordinates["tp"], self._shard_placements
        )


def skipped_for_overflow(scaler: LossScaler | None, model: ShardedModel) -> bool:
    """fp16, before clipping: unscale ``model``'s reduced gradient shards (in float32) and update the
    scale; True when any rank of the scaler's group (the whole job: every stage and replica) found an inf
    or nan — every rank then discarded its gradients and skips the step together."""
    if scaler is None:
        return False
    found_inf = scaler.unscale_(model)
    scaler.update(found_inf)
    return found_inf


def loss_scale_lines(scaler: LossScaler | None) -> list[str]:
    """The run summary's loss-scale line (fp16), empty otherwise."""
    if scaler is None:
        return []
    skipped = f"{scaler.skipped} step{'s' if scaler.skipped != 1 else ''} skipped for inf/nan gradients"
    return [f"Loss scale          = {scaler.scale:g} (fp16; {skipped})"]


def shard_axes(param: nn.Parameter, expert: bool) -> frozenset[str]:
    """The mesh axes a flat group's shard of ``param``'s kind is divided over: its replicas (ZeRO's
    shard; for experts, also ep, whose ranks hold other experts) and tp for tensor-parallel shards."""
    axes = EXPERT_SHARDS if expert else REPLICAS
    return axes | {"tp"} if shard_dim(param) is not None else axes


def expert_replicas(mesh: Mesh) -> tuple[ReplicaGroup, ...]:
    """Under ``--ep``: the experts, replicated over ``mesh.expert_replicas`` (dp·cp) only, their
    gradients there averaged and divided by ep (the combine's backward all-to-all already summed the ep
    ranks' tokens into each expert: see :mod:`~meshwise.parallel.expert_parallel.data_parallel`)."""
    ep = mesh.ep.world_size
    if ep == 1:
        return ()
    owns = lambda name, _param: is_expert_parameter(name)  # noqa: E731
    return (ReplicaGroup("experts", mesh.expert_replicas, owns, grad_scale=1 / ep),)
