"""The data-parallel :class:`~meshwise.train.step.ParallelStep`: any model, replicated over
``mesh.replicas``, its gradients averaged once per step.

``meshwise train mlp|cnn|deep-mlp`` runs it over every rank; ``meshwise train gpt`` over dp (and the cp
ranks, which hold the same weights for other tokens) of what tensor and expert parallelism left this rank,
with DataParallel(experts=...) as the wrapper under ``--ep``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from meshwise.comm.mesh import Mesh
from meshwise.parallel import DataParallel
from meshwise.train.step import Batch, Local, OptimizerFactory, ParallelStep


class DataParallelStep(ParallelStep):
    """DataParallel (or ``wrap``'s wrapper) of ``local.model`` over ``mesh.replicas``; the first
    micro-batches accumulate under ``no_sync``, so gradients are averaged once per step."""

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
        """This rank's own model where it holds it whole (no parameter divided over any axis), else
        gathered (collective: see the base)."""
        if not any(placement.divided for _param, placement in self.placements.values()):
            return self.local
        return super().full_model()
