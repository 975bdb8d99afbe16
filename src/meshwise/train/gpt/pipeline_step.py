"""``--pp``: the GPT training loop's step on a pipeline (× tensor parallel × data parallel) mesh.

Each rank keeps only its chunks of the model (cut by :mod:`meshwise.parallel.pipeline_parallel`), and one
``forward_backward`` is one pipeline step over the rank's micro-batches with the chosen schedule; the
executor sums the tied embedding/head gradient and averages over dp. Gradient clipping takes the norm of
the whole model: squares summed over this rank's parameters (the tied matrix counted once, on the first
stage) and over the pp group — dp replicas hold equal gradients after the executor's average.
Checkpoints and ``--sample`` are in :mod:`meshwise.train.gpt.pipeline_state`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import nn

from meshwise.comm.mesh import Mesh
from meshwise.models.gpt import GPT
from meshwise.parallel.pipeline_parallel import theoretical_bubble
from meshwise.parallel.pipeline_parallel.builder import build_pipeline
from meshwise.parallel.pipeline_parallel.executor import Event
from meshwise.parallel.pipeline_parallel.partition import LayerChunk
from meshwise.parallel.pipeline_parallel.timeline import COMPUTE_OPS, draw, gather_events
from meshwise.train.gpt.config import GPTTrainConfig
from meshwise.train.gpt.parallelize import Batch, LayerSharded, ParallelStep, build_optimizer
from meshwise.train.gpt.pipeline_state import (
    gather_plain_model,
    group_names,
    load_stage_state_dict,
    stage_state_dict,
)


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
        super().__init__(config, mesh, next(model.parameters()).device)
        self.mesh, self.config, self.sharded_loss = mesh, config, sharded.loss
        micro_batches = config.accumulation(mesh.shape.dp)
        self.executor, self.chunks = build_pipeline(
            model,
            plan,
            mesh.pp,
            schedule=config.schedule,
            micro_batches=micro_batches,
            virtual_stages=config.virtual_stages,
            dp=mesh.dp,
            loss=partial(sharded.loss, reduction="mean"),
            sequence_shards=tp if config.sp else 1,
            in_place=True,  # the model is this run's own (and a tp one holds a communicator: no copies)
        )
        self.model = StageModule(self.chunks)
        self.optimizer = build_optimizer(self.model, config)
        held = dict(self.model.named_parameters())
        copies = {b: a for a, b in plan.tied if b in held and a not in held}  # the last stage's head copy
        self.place(held.items(), divided={"pp"}, tied=copies)
        self._last_events: list[Event] = []
        self._theory = theoretical_bubble(mesh.shape.pp, micro_batches, config.virtual_stages)
        self._title = f"{config.schedule} pp={mesh.shape.pp} m={micro_batches} v={config.virtual_stages}"
        with torch.device("meta"):  # the whole model's shape, for parameter counts, without its memory
            self._shape_model = GPT(model.config)
            self._group_names = group_names(self._shape_model, build_optimizer(self._shape_model, config))

    def forward_backward(self, micro_batches: Sequence[Batch]) -> float:
        with self.autocast():
            result = self.executor.step([x for x, _ in micro_batches], [y for _, y in micro_batches])
        if self.profiler is not None:
            for event in result.events:
                if event.op in COMPUTE_OPS:
                    phase = "forward" if event.op == "F" else "backward"
                    label = f"{event.op}{event.micro_batch} chunk {event.chunk}"
                    self.profiler.record(phase, label, event.start, event.end)
        self._last_events = result.events
        return result.loss

    @torch.no_grad()
    def eval_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss_sum = partial(self.sharded_loss, reduction="sum")
        with self.autocast():
            return torch.tensor(self.executor.forward_only(inputs, targets, loss_sum), dtype=torch.float64)

    def full_model(self) -> GPT:
        """The model's shape on the meta device: parameter counts work, weights live in the stages."""
        return self._shape_model

    def sampling_model(self) -> GPT:
        """Collective over the pp group of dp replica 0: its stages' weights gathered into a plain GPT on
        its first stage (the job's rank 0); the other ranks get the meta-device shape."""
        if self.mesh.coordinates["dp"] != 0:
            return self._shape_model
        gathered = gather_plain_model(
            self.model, self._shape_model.config, self.mesh.pp, self.device, tp=self.mesh.tp
        )
        return self._shape_model if gathered is None else gathered

    def state_dict(self) -> dict:
        return stage_state_dict(
            self.model, self.optimizer, self._group_names, tp=self.mesh.tp, config=self._shape_model.config
        )

    def load_state_dict(self, state: dict) -> None:
        load_stage_state_dict(self.model, self.optimizer, state, tp=self.mesh.tp)

    def finish(self) -> None:
        """``--timeline``: the last step's diagram, drawn once (drawing is slower than a small step)."""
        if self.config.timeline is None or not self._last_events:
            return
        gathered = gather_events(self.mesh.pp, self._last_events)
        if gathered is None or self.mesh.coordinates["dp"] != 0:
            return
        draw(gathered, self.config.timeline, title=self._title, theory=self._theory)
