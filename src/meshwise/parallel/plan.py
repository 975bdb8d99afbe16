"""``ParallelPlan``: what a model declares so that every strategy can cut it without knowing it.

The strategies know layers, flat shards and schedules, never a particular model; a model says beside its
own code how it may be cut (as torchtitan does; ours is :mod:`meshwise.models.gpt_plan`): its repeated
**layers** (pipeline cut points, ZeRO-3's units), the **first / last** modules around them with the
functions that run them (a pipeline's first and last stage), the **tied** parameters (a copy on each of
two stages, gradients summed) and its **tensor_parallel** conversion, loss and check. A plan is plain
data, so users' own models get every strategy by writing one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from meshwise.comm.api import Communicator

#: ``(module holding the plan's first/last modules as attributes, input) -> output``
Runner = Callable[[nn.Module, torch.Tensor], torch.Tensor]
#: ``(output, targets) -> mean loss``
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TensorParallelPlan:
    """How the model becomes one rank's tensor-parallel shard, and the loss and checks that go with it."""

    #: ``(model, tp communicator, sequence_parallel) -> model``: converts in place, returns the model
    convert: Callable[[nn.Module, Communicator, bool], nn.Module]
    #: ``(sharded output, targets, tp communicator, reduction) -> loss``: the loss over this rank's slice
    loss: Callable[[torch.Tensor, torch.Tensor, Communicator, str], torch.Tensor]
    #: ``(tp, sequence_parallel, sequence length) -> None``: ValueError naming the fix when it cannot split
    check: Callable[[int, bool, int], None]


@dataclass(frozen=True)
class ParallelPlan:
    """A model's declaration of how it may be cut (see the module docstring)."""

    layers: str  # attribute path of the ModuleList of repeated layers
    first: tuple[str, ...]  # modules run before the layers, in the first pipeline stage
    last: tuple[str, ...]  # modules run after the layers, in the last pipeline stage
    enter: Runner  # runs `first` on the model's input
    leave: Runner  # runs `last` on the layers' output
    loss: Loss  # the training loss of the model's output
    #: ``input shape -> shape of the activations between layers`` (what a pipeline stage sends)
    activation_shape: Callable[[torch.Size], torch.Size]
    tied: tuple[tuple[str, str], ...] = ()  # (parameter of a `first` module, parameter of a `last` one)
    tensor_parallel: TensorParallelPlan | None = None

    def layer_modules(self, model: nn.Module) -> list[nn.Module]:
        """The repeated layers of ``model``: pipeline cut points, and ZeRO-3's units."""
        return list(model.get_submodule(self.layers))

    def check_tensor_parallel(self, tp: int, sequence_parallel: bool, seq_len: int) -> None:
        """Before launch: whether this model splits ``tp`` ways (ValueError naming the fix)."""
        if tp > 1 and self.tensor_parallel is None:
            raise ValueError("this model declares no tensor-parallel plan: drop --tp")
        if self.tensor_parallel is not None:
            self.tensor_parallel.check(tp, sequence_parallel, seq_len)
