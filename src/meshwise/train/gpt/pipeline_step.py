"""``--pp``: the GPT training loop's step on a pipeline (× tensor parallel × data parallel) mesh.

Each rank keeps only its chunks of the model, and one ``forward_backward`` is one pipeline step of the
executor over the rank's micro-batches. The stage's replicas (dp, ep and cp's ranks) average its
gradients by the executor's stage reducers, or with ``--zero`` by ZeRO's reduce-scatter of the stage's
accumulated gradients after the step. Clipping takes the whole model's norm: the placements say each
parameter is divided over pp (the tied head copy counted once, on the first stage). Checkpoints are the
seam's one writer: a stage holds its own names only (the head copy writes the tied embedding's keys,
which DCP writes once), with ``--zero`` its flat rectangles.

``--dtype fp16`` (with ``--zero``) computes as one fp16 ZeRO process does: float16 compute copies of
float32 master shards (no autocast), activations and their gradients travel between stages in float16,
and a :class:`~meshwise.parallel.zero.LossScaler` scales the loss on the last stage; the overflow verdict
is one MAX over the whole job, so every rank skips the same steps and keeps the same (power-of-two)
scale, by which the reported loss divides exactly.

ZeRO-3 keeps each stage's parameters gathered for the whole pipeline step and frees them after it (as
FSDP2 under torch's pipelining, ``reshard_after_forward=False``): a stage interleaves forwards and
backwards of its micro-batches on the same layers, so gathering around every instruction would cost 2·m
all-gathers per unit and step to save the stage's compute copies during the step only.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import nn

from meshwise.comm.mesh import Mesh
from meshwise.models.moe import moe_layers
from meshwise.parallel.pipeline_parallel import theoretical_bubble
from meshwise.parallel.pipeline_parallel.builder import build_pipeline
from meshwise.parallel.pipeline_parallel.executor import Event
from meshwise.parallel.pipeline_parallel.partition import LayerChunk
from meshwise.parallel.pipeline_parallel.schedules import COMPUTE
from meshwise.parallel.pipeline_parallel.timeline import draw, gather_events
from meshwise.parallel.placement import Placement
from meshwise.parallel.state_dict import Held
from meshwise.parallel.zero import LossScaler, shard
from meshwise.parallel.zero.sharded import ShardedModel
from meshwise.parallel.zero.state_dict import zero_held
from meshwise.train.gpt.config import GPTTrainConfig
from meshwise.train.gpt.parallelize import LayerSharded, build_optimizer, expert_replicas, tensor_parallel_key
from meshwise.train.step import Batch, ParallelStep
from meshwise.train.zero_step import clip_flat_shards, flat_placements, loss_scale_lines


class StageModule(nn.Module):
    """A rank's chunks as one module whose parameter names are the plain model's (``blocks.5.mlp.fc.weight``),
    for the optimizer, ``train()``/``eval()`` and name-keyed state."""

    def __init__(self, chunks: Sequence[LayerChunk]) -> None:
        super().__init__()
        blocks: dict[str, nn.Module] = {}
        for chunk in chunks:
            blocks.update(chunk.layers.items())
            if chunk.first:
                self.wte, self.wpe = chunk.wte, chunk.wpe
            if chunk.last:
                self.ln_f, self.head = chunk.ln_f, chunk.head
        self.blocks = nn.ModuleDict(blocks)


class PipelineStep(ParallelStep):
    """Pipeline parallelism (``--pp``, ``--schedule``, ``--virtual-stages``) for the GPT loop."""

    def __init__(self, sharded: LayerSharded, mesh: Mesh, config: GPTTrainConfig) -> None:
        """With ``--tp`` the model arrives as this rank's tensor-parallel shard (± ``--sp``) and every
        stage is cut from it; the stages' loss is then the vocabulary-parallel one."""
        model, plan, tp = sharded.model, sharded.plan, mesh.tp.world_size
        super().__init__(mesh, next(model.parameters()).device, config.model.torch_dtype)
        self.mesh, self.config, self.sharded_loss = mesh, config, sharded.loss
        # every rank skips together
        self.scaler = LossScaler(mesh.job) if config.model.dtype == "fp16" else None
        micro_batches = config.accumulation(mesh.shape.batch_size)  # dp·ep: ep ranks are data ranks
        self.executor, self.chunks = build_pipeline(
            model,
            plan,
            mesh.pp,
            schedule=config.mesh.schedule,
            micro_batches=micro_batches,
            virtual_stages=config.mesh.virtual_stages,
            # gradients averaged over the replicas (dp·ep·cp), experts over theirs (dp·cp); ZeRO
            # reduce-scatters each stage's itself
            dp=None if config.mesh.zero else mesh.replicas,
            experts=expert_replicas(mesh),
            loss=self._training_loss,
            sequence_shards=tp if config.mesh.sp else 1,
            in_place=True,  # the model is this run's own (and a tp one holds a communicator: no copies)
            activation_dtype=torch.float16 if self.scaler is not None else torch.float32,
        )
        self.model = StageModule(self.chunks)
        self.exchange_timer = sharded.exchange_timer
        held = dict(self.model.named_parameters())
        copies = {b: a for a, b in plan.tied if b in held and a not in held}  # the last stage's head copy
        self.zero: ShardedModel | None = None
        if config.mesh.zero:  # step 5 on each stage: ZeRO-1/2/3 of the stage's (tp) parameters over dp
            tied = {name for pair in plan.tied for name in pair}
            self.zero, self.optimizer, self._shard_placements = stage_zero(
                self.model, mesh, config, copies, tied
            )
            self.executor.gradient_of = self.zero.unsharded_gradient  # the tied sum, before the reduce
        else:
            self.optimizer = build_optimizer(self.model, config.optimizer)
            self.place(held.items(), divided={"pp"}, tied=copies)
        self._last_events: list[Event] = []

    def _training_loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's loss, multiplied by the loss scale under fp16."""
        loss = self.sharded_loss(output, targets, "mean")
        return loss if self.scaler is None else self.scaler.scale_loss(loss)

    def autocast(self) -> AbstractContextManager[Any]:
        """fp16 computes in ZeRO's float16 copies themselves (as one fp16 process does); bf16 autocasts."""
        return nullcontext() if self.scaler is not None else super().autocast()

    def gathered(self) -> AbstractContextManager[None]:
        """ZeRO-3: the stage's parameters gathered for what runs inside (nothing to do otherwise)."""
        return self.zero.gathered() if self.zero is not None else nullcontext()

    def forward_backward(self, micro_batches: Sequence[Batch]) -> float:
        scale = self.scaler.scale if self.scaler is not None else 1.0
        for layer in moe_layers(self.model):  # the loss is on the last stage: each adds its aux gradient
            layer.aux_gradient_scale = scale / len(micro_batches)
        accumulate = self.zero.no_sync() if self.zero is not None else nullcontext()
        with self.autocast(), accumulate, self.gathered(), self.timed_exchange(self.exchange_timer):
            result = self.executor.step([x for x, _ in micro_batches], [y for _, y in micro_batches])
        if self.zero is not None:  # the stage's gradients, tied copies summed, reduce-scattered over dp
            self.zero.reduce_accumulated()
        if self.profiler is not None:
            for event in result.events:
                if event.op in COMPUTE:
                    phase = "forward" if event.op == "F" else "backward"
                    label = f"{event.op}{event.micro_batch} chunk {event.chunk}"
                    self.profiler.record(phase, label, event.start, event.end)
        self._last_events = result.events
        return result.loss if self.scaler is None else result.loss / self.scaler.scale

    def clip_grad_norm(self, max_norm: float) -> float:
        if self.zero is None:
            return super().clip_grad_norm(max_norm)
        return clip_flat_shards(self.zero, self.scaler, self._shard_placements, max_norm, self.mesh)

    @torch.no_grad()
    def eval_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss_sum = partial(self.sharded_loss, reduction="sum")
        with self.autocast(), self.gathered():
            return torch.tensor(self.executor.forward_only(inputs, targets, loss_sum), dtype=torch.float64)

    def held(self) -> list[Held]:
        """The stage's parameters (from the placements), or with ``--zero`` the rectangles of its flat
        ranges: each (dp, tp) rank of each stage writes its own."""
        if self.zero is None:
            return super().held()
        return zero_held(self.zero, self.plain, self.mesh.coordinates["tp"], self._shard_placements)

    def summary_lines(self) -> list[str]:
        """fp16: the loss scale and the steps skipped."""
        return loss_scale_lines(self.scaler)

    def finish(self) -> None:
        """``--timeline``: the last step's diagram, drawn once (drawing is slower than a small step)."""
        if self.config.profile.timeline is None or not self._last_events:
            return
        gathered = gather_events(self.mesh.pp, self._last_events)
        if gathered is None or self.mesh.replicas.rank != 0:
            return
        s = self.executor.schedule
        title = f"{s.name} pp={s.stages} m={s.micro_batches} v={s.virtual_stages}"
        theory = theoretical_bubble(s.stages, s.micro_batches, s.virtual_stages)
        draw(gathered, self.config.profile.timeline, title=title, theory=theory)


def stage_zero(
    stage: StageModule, mesh: Mesh, config: GPTTrainConfig, copies: dict[str, str], tied: set[str]
) -> tuple[ShardedModel, torch.optim.Optimizer, list[Placement]]:
    """ZeRO-1/2/3 of a pipeline stage over ``mesh.replicas`` (dp·cp): the sharded stage, AdamW over its
    master shards, and each flat group's placement (divided over the replicas and pp, and tp for tp
    shards; the last stage's tied head copy in a group of its own, counted once in the norm, on the first
    stage). Both ends of a tied pair (``tied``: their names) get a group of their own, so the first stage's
    embedding and the last stage's head copy are cut into the same flat ranges and write the same
    checkpoint rectangles of their shared entry (DCP keeps one of two identical writes; two different cuts
    would overlap)."""

    def key(name: str, param: nn.Parameter) -> tuple[bool, bool, bool]:
        return (*tensor_parallel_key(name, param), name in tied)

    units = list(stage.blocks.values()) if config.mesh.zero == 3 else None
    precision = "fp16" if config.model.dtype == "fp16" else None  # bf16 autocasts over float32 stages
    zero = shard(
        stage,
        mesh.replicas,
        stage=config.mesh.zero,
        mixed_precision=precision,
        separate_by=key,
        units=units,
        experts=expert_replicas(mesh),  # --ep: the stage's experts over their own replicas
    )
    optimizer = build_optimizer(zero, config.optimizer)
    return zero, optimizer, flat_placements(zero, frozenset({"pp"}), copies)
