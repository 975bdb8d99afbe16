"""Where each parameter lies on the mesh — one record per parameter — and what is computed from it once.

A :class:`Placement` says, for one parameter of the plain model, over which mesh axes a rank's local copy
is *divided* (each element held by exactly one rank of the axis: ``tp`` a tensor dimension, ``pp`` the
owning stage, ``dp`` ZeRO's flat shard) and whether it is *tied* to another parameter (the last stage's
head copy of the embedding); along every other axis it is replicated. So the global gradient norm is
written once for every layout: each element counted on the rank at coordinate 0 of every axis it is
replicated over, never on a tied copy, and one all-reduce over the job sums the counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from meshwise.comm.api import Communicator, ReduceOp
from meshwise.comm.mesh import AXES
from meshwise.parallel.tensor_parallel.layers import shard_dim


@dataclass(frozen=True)
class Placement:
    """How one parameter of the plain model lies on the mesh (see the module docstring)."""

    name: str  # the plain model's name
    divided: frozenset[str] = frozenset()  # axes whose ranks hold disjoint parts of it
    tp_dim: int | None = None  # the tensor dimension cut over tp (None for a flat shard of several)
    tied_to: str | None = None  # this copy mirrors that parameter (kept equal; counted there)

    def __post_init__(self) -> None:
        unknown = self.divided - set(AXES)
        if unknown:
            raise ValueError(f"placement of {self.name}: unknown mesh axes {sorted(unknown)}")
        if self.tp_dim is not None and "tp" not in self.divided:
            raise ValueError(f"placement of {self.name}: a tp_dim needs tp among the divided axes")

    def counted_at(self, coordinates: Mapping[str, int]) -> bool:
        """Whether this rank's copy counts in a sum over the whole model: not a tied copy, and the first
        of its replicas along every axis it is replicated over."""
        return self.tied_to is None and all(
            coordinates[axis] == 0 for axis in AXES if axis not in self.divided
        )


def place(
    named: Iterable[tuple[str, nn.Parameter]],
    *,
    divided: Iterable[str] = (),
    tied: Mapping[str, str] | None = None,
) -> dict[str, Placement]:
    """Placements of a rank's local parameters: each divided over ``divided`` (e.g. ``{"pp"}`` for a
    pipeline stage's), over ``tp`` too where the parameter carries a tensor-parallel shard dimension;
    ``tied`` maps a local name to the parameter it is a copy of."""
    axes = frozenset(divided)
    result = {}
    for name, param in named:
        dim = shard_dim(param)
        result[name] = Placement(
            name,
            divided=axes | {"tp"} if dim is not None else axes,
            tp_dim=dim,
            tied_to=(tied or {}).get(name),
        )
    return result


def clip_gradients_(
    grads: Sequence[tuple[torch.Tensor | None, Placement]],
    max_norm: float,
    coordinates: Mapping[str, int],
    job: Communicator,
) -> float:
    """Scale every local gradient (a parameter's, or a ZeRO gradient shard) so the whole model's norm is
    at most ``max_norm`` (0: only measure), by torch's ``clip_grad_norm_`` rule (``max_norm / (norm +
    1e-6)`` when below 1); returns the norm. Collective over ``job`` (every rank of the mesh): each element
    is counted once (:meth:`Placement.counted_at`, so tied copies are scaled but not counted), the squares
    summed in float64."""
    total = torch.zeros(1, dtype=torch.float64)
    for grad, placement in grads:
        if grad is not None and placement.counted_at(coordinates):
            total += grad.detach().double().square().sum()
    job.all_reduce(total, ReduceOp.SUM)
    norm = math.sqrt(total.item())
    coefficient = max_norm / (norm + 1e-6)
    if max_norm > 0 and coefficient < 1:
        for grad, _ in grads:
            if grad is not None:
                grad.mul_(coefficient)
    return norm
