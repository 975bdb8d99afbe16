"""The seam between a training loop and the parallel strategies: :class:`ParallelStep`.

Both loops (:mod:`meshwise.train.loop`, :mod:`meshwise.train.gpt.loop`) know nothing about how the model
is cut: they only call the methods of a ParallelStep — this rank's part of the model, its optimizer, and
how one step's micro-batches turn into gradients. The data-parallel and ZeRO steps
(:class:`DataParallelStep`, :mod:`meshwise.train.zero_step`) are model-agnostic: the loss arrives in a
:class:`Local`, the optimizer from the caller's factory; :mod:`meshwise.train.gpt.parallelize` adds what
only the GPT has (tensor, context, expert and pipeline parallelism).

What every ParallelStep guarantees, so the loops and their parity tests hold for every strategy:

- ``forward_backward`` leaves the mean gradient over the *global* batch (all dp ranks' micro-batches) and
  returns this rank's mean micro-batch loss;
- ``clip_grad_norm`` clips by the norm of the *whole* model's gradient and returns it;
- ``eval_loss_sum`` is one evaluation batch's summed loss, without gradients;
- ``held()`` describes the rank's pieces of the plain model's tensors, from which ``state_dict()`` /
  ``load_state_dict()`` — written once, here — key model and optimizer state by the plain model's names
  (DCP reshards between layouts by those names), and ``full_model()`` reassembles the plain model.

Under ``--profile`` the step brackets its phases with :meth:`ParallelStep.phase` (the pipeline records its
instructions), so a new strategy is profiled from its first day.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshwise.comm.mesh import Mesh
from meshwise.parallel import DataParallel
from meshwise.parallel.expert_parallel import ExchangeTimer, is_expert_parameter
from meshwise.parallel.placement import Placement, clip_gradients_, place
from meshwise.parallel.state_dict import (
    Held,
    PlainLayout,
    finish_load,
    gather_plain,
    held_parameters,
    sharded_state_dict,
)
from meshwise.parallel.zero import LossScaler
from meshwise.train.profile import StepProfiler

Batch = tuple[torch.Tensor, torch.Tensor]
#: ``loss(output, targets, reduction)``: the model's loss, ``reduction`` ``"mean"`` or ``"sum"``
Loss = Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]
#: builds the optimizer over the module whose parameters the step updates (a model, or ZeRO's shards)
OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]


def loss_only(loss: torch.Tensor, _model: nn.Module) -> torch.Tensor:
    """A model whose training gradient is its loss's alone (no auxiliary losses)."""
    return loss


@dataclass(frozen=True)
class Local:
    """This rank's model as data parallelism or ZeRO receive it, with what it is trained on."""

    model: nn.Module
    loss: Loss
    #: ``(loss, model) -> loss``: what joins the training gradient besides it (a MoE's auxiliary losses)
    training_loss: Callable[[torch.Tensor, nn.Module], torch.Tensor]
    exchange_timer: ExchangeTimer | None  # --ep --profile: the experts' dispatch/combine seconds


class ParallelStep(ABC):
    """One rank's view of a parallel training step (see the module docstring for the contract)."""

    model: nn.Module  # what this rank holds and runs forward on
    optimizer: torch.optim.Optimizer
    profiler: StepProfiler | None = None  # set by the loop under --profile
    scaler: LossScaler | None = None  # fp16's loss scaler (its state joins the checkpoint)
    #: the plain model's names, shapes and optimizer groups (what checkpoints are keyed by), and how to
    #: build it for :meth:`full_model`: set by whoever builds the step, from the model before any cut
    plain: PlainLayout
    plain_model: Callable[[], nn.Module]

    #: this rank's parameters under the plain model's names, with where each lies on the mesh; a strategy
    #: that keeps them (not ZeRO's flat shards) sets it, and :meth:`clip_grad_norm` needs nothing else
    placements: dict[str, tuple[nn.Parameter, Placement]]
    #: ``--ep`` under ``--profile``: seconds of each step in the experts' dispatch and combine
    exchange_seconds: list[dict[str, float]]

    def __init__(self, mesh: Mesh, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        self.device, self.dtype, self.mesh = device, dtype, mesh
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

    @contextmanager
    def timed_exchange(self, timer: ExchangeTimer | None) -> Iterator[None]:
        before = dict(timer.seconds) if timer is not None else {}
        try:
            yield
        finally:
            if timer is not None:
                self.exchange_seconds.append({part: timer.seconds[part] - before[part] for part in before})

    def autocast(self) -> AbstractContextManager[Any]:
        """bf16 mixed precision: weights, gradients and optimizer stay fp32; matmuls run in bf16."""
        if self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def phase(self, name: str) -> AbstractContextManager[Any]:
        """Times ``name`` (``forward``, ``backward``) inside the step when profiling; free otherwise."""
        return nullcontext() if self.profiler is None else self.profiler.phase(name)

    def finish(self) -> None:
        """Collective, once after the last step: the strategy's end-of-run output (none by default)."""

    def accumulate_gradients(
        self,
        micro_batches: Sequence[Batch],
        loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> float:
        """Forward and backward of each micro-batch, all but the last under ``no_sync()`` (gradients are
        reduced once per step), each loss divided by their number (the batch mean), then ``scale``-d (a
        loss scaler). Returns the mean loss."""
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
        """From the placements: one all-reduce of the shards' squares."""
        grads = [(param.grad, placement) for param, placement in self.placements.values()]
        return clip_gradients_(grads, max_norm, self.mesh.coordinates, self.mesh.job)

    @abstractmethod
    def eval_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...

    def full_model(self) -> nn.Module:
        """The plain model, for sampling, export and parity checks, from every rank's :meth:`held` pieces
        (the checkpoint's descriptions; ZeRO's float32 masters): collective, every rank gets it."""
        full = self.plain_model().to(self.device)
        full.load_state_dict(gather_plain(self.held(), self.plain, self.mesh.coordinates, self.mesh.job))
        return full

    def sampling_model(self) -> nn.Module:
        """The model generation runs on (rank 0 alone); every rank calls it (it may be collective)."""
        return self.full_model()

    def memory_lines(self) -> list[str]:
        """Every rank's memory report, one line each (collective); none where each holds the model whole."""
        return []

    def summary_lines(self) -> list[str]:
        """The strategy's own lines in the run's summary (collective)."""
        return []

    def held(self) -> list[Held]:
        """What this rank's optimizer steps, as pieces of the plain model's tensors: each parameter of
        :attr:`placements` whole or its tensor-parallel slice (ZeRO gives its flat rectangles)."""
        return held_parameters(self.placements.values(), self.plain, self.mesh.coordinates["tp"])

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state by the plain model's names, views of this rank's own pieces, and
        fp16's loss scale."""
        module = getattr(self.model, "module", self.model)  # inside a DataParallel / ZeRO wrapper
        state = sharded_state_dict(self.held(), self.optimizer, module, self.plain)
        return state | ({"scaler": self.scaler.state_dict()} if self.scaler is not None else {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Finish a ``dcp.load`` into :meth:`state_dict`'s views (of a checkpoint of any layout)."""
        finish_load(self.held())
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])


class DataParallelStep(ParallelStep):
    """The data-parallel step of any model: DataParallel (or ``wrap``'s wrapper) of ``local.model`` over
    ``mesh.replicas``. ``train mlp|cnn|deep-mlp`` runs it over every rank; ``train gpt`` over dp (and cp,
    whose ranks hold the same weights for other tokens) of what tensor and expert parallelism left this
    rank, with DataParallel(experts=...) as the wrapper under ``--ep``."""

    def __init__(
        self,
        local: Local,
        mesh: Mesh,
        optimizer: OptimizerFactory,
        dtype: torch.dtype = torch.float32,
        wrap: Callable[[nn.Module], nn.Module] | None = None,
    ) -> None:
        super().__init__(mesh, next(local.model.parameters()).device, dtype)
        self.sharded, self.local = local, local.model
        self.model = wrap(self.local) if wrap is not None else DataParallel(self.local, mesh.replicas)
        self.optimizer = optimizer(self.local)
        self.place(self.local.named_parameters())

    def forward_backward(self, micro_batches: Sequence[Batch]) -> float:
        with self.timed_exchange(self.sharded.exchange_timer):
            return self.accumulate_gradients(micro_batches, self._loss)

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        # evaluation runs the inner model: the wrapper's gradient bookkeeping is for training
        with self.autocast():
            output = self.model(inputs) if reduction == "mean" else self.local(inputs)
        loss = self.sharded.loss(output, targets, reduction)
        # what else joins the training gradient (not evaluation's sums)
        return self.sharded.training_loss(loss, self.model) if reduction == "mean" else loss

    @torch.no_grad()
    def eval_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._loss(inputs, targets, reduction="sum")

    def full_model(self) -> nn.Module:
        """This rank's own model where no parameter is divided over any axis, else gathered."""
        if not any(placement.divided for _param, placement in self.placements.values()):
            return self.local
        return super().full_model()
