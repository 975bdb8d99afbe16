"""The seam between the GPT training loop and the parallel strategies.

The loop (:mod:`meshwise.train.gpt.loop`) knows nothing about how the model is cut. It asks
:func:`parallelize` for a :class:`ParallelStep` — this rank's part of the model, its optimizer, and how
one step's micro-batches turn into gradients — and then only calls that object's methods.
:func:`parallelize` applies the strategies in one fixed order (tensor → context → experts → pipeline →
recomputation → data parallel / ZeRO), and :func:`check_supported` refuses, before any rank starts, a
combination that cannot be built.

What a ParallelStep must guarantee, so the loop and its tests stay valid for every strategy:

- ``forward_backward(micro_batches)`` leaves in the gradients (or their shards) the mean over the
  *global* batch — the dp ranks' micro-batches together — and returns this rank's mean micro-batch loss;
- ``clip_grad_norm(max_norm)`` clips by the norm of the *whole* model's gradient (a sharded strategy
  reduces the squares of its shards) and returns that norm;
- ``held()`` describes what the rank holds as pieces of the plain model's tensors (by default from the
  :attr:`~ParallelStep.placements`; ZeRO gives its flat rectangles), from which ``state_dict()`` /
  ``load_state_dict()`` — written once, here — give model and optimizer state keyed by the plain model's
  names, each rank's own pieces only (DCP reshards between layouts by those names);
- ``full_model()`` returns the plain GPT (for ``--sample``, ``--export-hf`` and parity checks), reassembled
  from the same descriptions as the checkpoint (collective over the job: every rank calls it and gets it),
  or the rank's own model where it holds it whole; ``sampling_model()`` is what generation runs on.

Under ``--profile`` the loop sets ``profiler`` and times the whole ``forward_backward`` as one phase, so
a new strategy is profiled from its first day (communication carved out by the flight recorders); it
tells forward from backward by bracketing them with :meth:`ParallelStep.phase`, or, like the pipeline,
by :meth:`~meshwise.train.profile.StepProfiler.record`-ing the instructions it ran.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshwise.comm.api import Communicator
from meshwise.comm.mesh import Mesh
from meshwise.models.gpt import GPT, GPTConfig, language_model_loss
from meshwise.models.gpt_plan import gpt_plan
from meshwise.models.moe import moe_layers, with_auxiliary_losses
from meshwise.parallel import DataParallel
from meshwise.parallel.context_parallel import apply_context_parallel
from meshwise.parallel.expert_parallel import (
    ExchangeTimer,
    ExpertDataParallel,
    apply_expert_parallel,
    is_expert_parameter,
)
from meshwise.parallel.placement import Placement, clip_gradients_, place
from meshwise.parallel.plan import ParallelPlan
from meshwise.parallel.state_dict import (
    Held,
    PlainLayout,
    finish_load,
    gather_plain,
    held_parameters,
    sharded_state_dict,
)
from meshwise.parallel.zero import LossScaler
from meshwise.train.gpt.config import GPTTrainConfig
from meshwise.train.gpt.context_parallel import check_context_parallel_config, plain_copy
from meshwise.train.gpt.optimizer import build_optimizer
from meshwise.train.gpt.recompute import recompute_step
from meshwise.train.gpt.resolve import GPTRun
from meshwise.train.profile import StepProfiler

Batch = tuple[torch.Tensor, torch.Tensor]


class ParallelStep(ABC):
    """One rank's view of a parallel training step (see the module docstring for the contract)."""

    model: nn.Module  # what this rank holds and runs forward on
    optimizer: torch.optim.Optimizer
    profiler: StepProfiler | None = None  # set by the loop under --profile
    scaler: LossScaler | None = None  # fp16's loss scaler (its state joins the checkpoint)
    #: the plain model's names, shapes and optimizer groups: what checkpoints are keyed by, and its config
    #: (set by :func:`parallelize`, from the model before any strategy cut it)
    plain: PlainLayout
    plain_config: GPTConfig

    #: this rank's parameters under the plain model's names, with where each lies on the mesh; a strategy
    #: that keeps them (not ZeRO's flat shards) sets it, and :meth:`clip_grad_norm` needs nothing else
    placements: dict[str, tuple[nn.Parameter, Placement]]
    #: ``--ep`` under ``--profile``: seconds of each step in the experts' dispatch and combine
    exchange_seconds: list[dict[str, float]]

    def __init__(self, config: GPTTrainConfig, mesh: Mesh, device: torch.device) -> None:
        self.device = device
        self.dtype = config.model.torch_dtype
        self.mesh = mesh
        self.placements = {}
        self.exchange_seconds = []

    def place(self, named: Iterable[tuple[str, nn.Parameter]], **how: Any) -> None:
        """Record this rank's ``named`` parameters' placements (``how``: see :func:`place`); under
        ``--ep`` each expert's parameters are divided over ``ep`` too (every ep rank holds other experts)."""
        named = list(named)
        params = dict(named)
        experts = [(n, p) for n, p in named if self.mesh.shape.ep > 1 and is_expert_parameter(n)]
        dense = [(n, p) for n, p in named if not (self.mesh.shape.ep > 1 and is_expert_parameter(n))]
        placed = place(dense, **how)
        if experts:
            placed |= place(experts, **(how | {"divided": {*how.get("divided", ()), "ep"}}))
        self.placements = {name: (params[name], p) for name, p in placed.items()}

    def timed_exchange(self, timer: ExchangeTimer | None) -> AbstractContextManager[Any]:
        """Records this step's dispatch and combine seconds in :attr:`exchange_seconds` (``--profile``)."""
        return nullcontext() if timer is None else _exchange_step(timer, self.exchange_seconds)

    def autocast(self) -> AbstractContextManager[Any]:
        """bf16 mixed precision: weights, gradients and optimizer stay fp32; matmuls run in bf16."""
        if self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def phase(self, name: str) -> AbstractContextManager[Any]:
        """Times ``name`` (``forward``, ``backward``) inside the step when profiling; free otherwise."""
        return nullcontext() if self.profiler is None else self.profiler.phase(name)

    def finish(self) -> None:
        """Collective, once after the last step: end-of-run output of the strategy (none by default)."""

    def accumulate_gradients(
        self,
        micro_batches: Sequence[Batch],
        loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> float:
        """Forward and backward of each micro-batch, ``self.model.no_sync()`` for all but the last (so
        gradients are reduced once per step), each loss divided by their number so the gradients are the
        batch mean; ``scale`` (e.g. a loss scaler) applies to that before backward. Returns the mean loss."""
        total = 0.0
        for i, (inputs, targets) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with self.model.no_sync() if not last else nullcontext():  # type: ignore[operator]
                with self.phase("forward"):
                    loss = loss_of(inputs, targets)
                    total += loss.item()
                with self.phase("backward"):
                    scaled = loss / len(micro_batches)
                    (scale(scaled) if scale is not None else scaled).backward()
        return total / len(micro_batches)

    @abstractmethod
    def forward_backward(self, micro_batches: Sequence[Batch]) -> float: ...

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip by the norm of the whole model's gradient, from the placements (one all-reduce)."""
        grads = [(param.grad, placement) for param, placement in self.placements.values()]
        return clip_gradients_(grads, max_norm, self.mesh.coordinates, self.mesh.job)

    @abstractmethod
    def eval_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def full_model(self) -> GPT:
        """The plain GPT from every rank's pieces (:meth:`held`), on every rank: collective over the job
        (:func:`~meshwise.parallel.state_dict.gather_plain`; ZeRO's float32 masters, not compute copies)."""
        full = GPT(self.plain_config).to(self.device)
        full.load_state_dict(gather_plain(self.held(), self.plain, self.mesh.coordinates, self.mesh.job))
        return full

    def sampling_model(self) -> GPT:
        """The model ``--sample`` generates with on rank 0; every rank calls it (it may be collective)."""
        return self.full_model()

    def summary_lines(self) -> list[str]:
        """Strategy-specific lines for the run's summary (collective: every rank calls it at the end)."""
        return []

    def held(self) -> list[Held]:
        """What this rank's optimizer steps, as pieces of the plain model's tensors: each parameter of
        :attr:`placements` whole, or its tensor-parallel slice (a sharded strategy gives its own)."""
        return held_parameters(self.placements.values(), self.plain, self.mesh.coordinates["tp"])

    def state_dict(self) -> dict[str, Any]:
        """Model and AdamW state under the plain model's names, views of this rank's own pieces
        (:func:`~meshwise.parallel.state_dict.sharded_state_dict`), and fp16's loss scale."""
        module = getattr(self.model, "module", self.model)  # inside a DataParallel / ZeRO wrapper
        state = sharded_state_dict(self.held(), self.optimizer, module, self.plain)
        return state | ({"scaler": self.scaler.state_dict()} if self.scaler is not None else {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Finish a ``dcp.load`` into :meth:`state_dict`'s views (of a checkpoint of any layout)."""
        finish_load(self.held())
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])


@dataclass(frozen=True)
class LayerSharded:
    """The model after the strategies that cut layers — 1. tensor parallelism (± sequence parallelism)
    from the model's plan, 2. context parallelism (slot) — with the loss of its (possibly vocabulary-
    sharded) output; what the pipeline and data parallelism / ZeRO then cut and wrap."""

    model: GPT  # this rank's model: the whole GPT, or its tensor-parallel shard (± only its experts)
    plan: ParallelPlan
    tp: Communicator
    loss: Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]  # (output, targets, "mean" | "sum")
    exchange_timer: ExchangeTimer | None = None  # --ep --profile: the experts' dispatch/combine seconds


def shard_layers(model: GPT, mesh: Mesh, config: GPTTrainConfig) -> LayerSharded:
    """Steps 1, 2 and 2b of :func:`parallelize`, in place on ``model`` (cp after tp: it changes only how
    the heads a rank holds attend, and wraps sequence parallelism's position lookup)."""
    plan = gpt_plan(model.config)
    loss = plain_loss
    if mesh.tp.world_size > 1:
        assert plan.tensor_parallel is not None  # check_supported refused it otherwise
        tensor_parallel = plan.tensor_parallel
        tensor_parallel.convert(model, mesh.tp, config.mesh.sp)

        def loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
            return tensor_parallel.loss(logits.float(), targets, mesh.tp, reduction)

    # 2. the attention over the cp group and the positions of this rank's chunks (the loop feeds it
    # local_tokens of each batch); a no-op for a cp group of one
    apply_context_parallel(model, mesh.cp)
    timer = None
    if mesh.ep.world_size > 1:  # 2b. experts: this rank keeps E/ep of each MoE layer's, tokens all-to-all
        apply_expert_parallel(model, mesh.ep)
        timer = ExchangeTimer() if config.profile.profiling else None
        for layer in moe_layers(model):
            layer.exchange.timer = timer  # type: ignore[attr-defined]
    return LayerSharded(model, plan, mesh.tp, loss, timer)


def plain_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy over whole logits, computed in float32 (as autocast would)."""
    if reduction == "mean":
        return language_model_loss(logits.float(), targets)
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
    )


class DataParallelStep(ParallelStep):
    """DataParallel over ``mesh.replicas`` (dp, and the cp ranks that hold the same weights for other
    tokens) of this rank's model — the whole GPT, or with ``--tp`` its tensor-parallel shard; gradients
    are averaged once per step (the first micro-batches accumulate under ``no_sync``). With ``--ep`` the
    model holds E/ep experts per layer and
    :class:`~meshwise.parallel.expert_parallel.ExpertDataParallel` averages dense gradients over
    ``mesh.replicas`` and expert gradients over ``mesh.expert_replicas``."""

    def __init__(self, sharded: LayerSharded, mesh: Mesh, config: GPTTrainConfig) -> None:
        super().__init__(config, mesh, next(sharded.model.parameters()).device)
        self.sharded, self.local = sharded, sharded.model
        self.ep = mesh.ep.world_size
        if self.ep > 1:
            self.model = ExpertDataParallel(self.local, mesh.replicas, mesh.expert_replicas, self.ep)
        else:
            self.model = DataParallel(self.local, mesh.replicas)
        self.optimizer = build_optimizer(self.local, config.optimizer)
        self.place(self.local.named_parameters())

    def forward_backward(self, micro_batches: Sequence[Batch]) -> float:
        with self.timed_exchange(self.sharded.exchange_timer):
            return self.accumulate_gradients(micro_batches, self._loss)

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        with self.autocast():
            logits = self.model(inputs) if reduction == "mean" else self.local(inputs)
        loss = self.sharded.loss(logits, targets, reduction)
        # a MoE model's load-balancing and z-losses join the training gradient (not evaluation's sums)
        return with_auxiliary_losses(loss, self.model) if reduction == "mean" else loss

    @torch.no_grad()
    def eval_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._loss(inputs, targets, reduction="sum")

    def full_model(self) -> GPT:
        """This rank's own GPT where it holds it whole, else gathered (collective: see the base)."""
        if self.sharded.tp.world_size == 1 and self.ep == 1:
            return self.local
        return super().full_model()

    def sampling_model(self) -> GPT:
        """Under ``--cp`` a plain copy (the model's own attention is collective over its cp group)."""
        full = self.full_model()
        return plain_copy(full) if full is self.local and self.mesh.cp.world_size > 1 else full


@contextmanager
def _exchange_step(timer: ExchangeTimer, steps: list[dict[str, float]]) -> Iterator[None]:
    before = dict(timer.seconds)
    try:
        yield
    finally:
        steps.append({part: timer.seconds[part] - before[part] for part in before})


def check_supported(run: GPTRun) -> None:
    """A clear error, before any rank starts, for a composition that cannot be built (or is not yet)."""
    mesh = run.config.mesh
    if mesh.sp and mesh.tp < 2:
        raise ValueError("--sp splits the sequence across the tensor-parallel ranks: add --tp 2 or more")
    run.config.mesh_shape(run.world_size)  # the degree checks: sizes that divide the ranks
    check_context_parallel_config(run)
    local_seq = run.seq_len // mesh.cp  # what tensor (± sequence) parallelism sees of it
    gpt_plan(run.model_config).check_tensor_parallel(mesh.tp, mesh.sp, local_seq)


def step_class(config: GPTTrainConfig) -> type[ParallelStep]:
    """Which class runs steps 3–5 of :func:`parallelize` for the config."""
    from meshwise.train.gpt.pipeline_step import PipelineStep  # the steps subclass ParallelStep (above)
    from meshwise.train.gpt.zero_step import ZeroStep

    if config.mesh.pp > 1:
        return PipelineStep
    return ZeroStep if config.mesh.zero else DataParallelStep


def parallelize(model: GPT, mesh: Mesh, run: GPTRun) -> ParallelStep:
    """This rank's :class:`ParallelStep` for ``model`` (built identically on every rank, converted in
    place) over ``mesh``.

    Strategies apply in one fixed order, whatever the combination:

    1. tensor parallelism (± sequence parallelism) — the model's plan converts it to this rank's shard
       over ``mesh.tp`` (:func:`shard_layers`);
    2. context parallelism over ``mesh.cp`` — attention over the cp group, positions of the rank's
       chunks (:func:`shard_layers`; the loop feeds each rank its chunks of every sequence);
    3. the pipeline — the (tensor-parallel) model cut into stages along the plan's layers, over
       ``mesh.pp`` (:class:`~meshwise.train.gpt.pipeline_step.PipelineStep`);
    4. activation recomputation of the layers this rank runs;
    5. data parallelism over ``mesh.replicas`` (dp, and cp: ranks with the same weights and other
       tokens) of what the rank holds: DataParallel's bucketed all-reduce
       (:class:`DataParallelStep`), or ZeRO-1/2/3 sharding those (tensor-parallel) parameters further
       (:class:`~meshwise.train.gpt.zero_step.ZeroStep`).

    So ZeRO shards tensor-parallel shards, never the reverse (Megatron's distributed optimizer; FSDP2
    over DTensor TP).
    """
    check_supported(run)
    config = run.config
    with torch.device("meta"):  # the plain model's names and groups, before the strategies cut it
        shape = GPT(model.config)
        plain = PlainLayout.of(shape, build_optimizer(shape, config.optimizer))
    step = step_class(config)(shard_layers(model, mesh, config), mesh, config)
    step.plain, step.plain_config = plain, model.config
    recompute_step(step.model, config.mesh)  # 4. --recompute: on the blocks this rank runs, whatever cut them
    return step
