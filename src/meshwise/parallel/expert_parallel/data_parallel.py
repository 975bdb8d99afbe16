"""Data parallelism for a model whose experts are spread over ``ep``: two reducers, one per kind of weight.

Under ``--ep`` a rank's dense (non-expert) weights are the same on every rank of ``mesh.replicas``
(dp·ep·cp) and its experts on every rank of ``mesh.expert_replicas`` (dp·cp), so their gradients average
over those groups — one :class:`~meshwise.parallel.data_parallel.reducer.GradReducer` each, bucketed and
overlapped with backward as :class:`~meshwise.parallel.DataParallel` is. :func:`replica_groups` is that
split, written once: :class:`ExpertDataParallel` uses it for a whole model, and a pipeline stage's
reducers (:mod:`~meshwise.parallel.pipeline_parallel.stage_reducer`) for each of its chunks.

An expert's gradient needs one more factor. Each rank's loss is the mean over its own tokens, and the
global loss is the mean of the D = |replicas| ranks' losses. The combine's backward all-to-all already
*sums* into each expert the gradients of the ep ranks' tokens routed to it, so the expert replicas' average
of those sums is ep times the global mean's gradient: a hook divides by ep as the gradient is produced
(before accumulation, so micro-batches under ``no_sync`` and the reducers see the right value, and a
split backward's weight pass, which adds its gradients through autograd, goes through it too).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

from meshwise.comm.api import Communicator
from meshwise.parallel.data_parallel.buckets import MIB, plan_buckets
from meshwise.parallel.data_parallel.data import broadcast_tensors
from meshwise.parallel.data_parallel.reducer import GradReducer
from meshwise.parallel.expert_parallel.placement import is_expert_parameter

NamedParameters = list[tuple[str, nn.Parameter]]
_DIVIDED = "_meshwise_divided_by_ep"  # set on an expert parameter whose gradient hook divides by ep


@dataclass(frozen=True)
class ExpertReplicas:
    """Where expert gradients average: ``comm`` holds the ranks with this rank's experts
    (``mesh.expert_replicas``: dp·cp) and ``ep`` is the degree their sums are divided by."""

    comm: Communicator
    ep: int


def replica_groups(
    named: Sequence[tuple[str, nn.Parameter]], replicas: Communicator, experts: ExpertReplicas | None = None
) -> list[tuple[NamedParameters, Communicator]]:
    """``named`` split by the ranks each parameter's gradient averages over: all over ``replicas``, or with
    ``experts`` the expert parameters apart, over ``experts.comm``; empty groups are left out.

    With ``experts`` of ``ep`` > 1 this registers on each expert parameter (once) the hook that divides
    its gradient by ep (see the module docstring) — whether or not a group of one rank reduces anything."""
    if experts is None:
        return [(list(named), replicas)] if named else []
    dense = [(name, p) for name, p in named if not is_expert_parameter(name)]
    mine = [(name, p) for name, p in named if is_expert_parameter(name)]
    if experts.ep > 1:
        for _, param in mine:
            if not getattr(param, _DIVIDED, False):  # once, however many wrappers split the parameter
                setattr(param, _DIVIDED, True)
                param.register_hook(lambda grad, ep=experts.ep: grad / ep)
    return [(params, comm) for params, comm in ((dense, replicas), (mine, experts.comm)) if params]


class ExpertDataParallel(nn.Module):
    """``module`` (its experts already cut by :func:`apply_expert_parallel`) with dense gradients averaged
    over ``replicas`` and expert gradients over ``expert_replicas`` (divided by ``ep``, see above)."""

    def __init__(
        self,
        module: nn.Module,
        replicas: Communicator,
        expert_replicas: Communicator,
        ep: int,
        *,
        bucket_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
    ) -> None:
        super().__init__()
        self.module = module
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._require_sync = True
        self._reducers: list[GradReducer] = []
        for params, comm in replica_groups(named, replicas, ExpertReplicas(expert_replicas, ep)):
            broadcast_tensors([p for _, p in params], comm)  # the group's first rank's values everywhere
            if comm.world_size > 1:
                buckets = plan_buckets(
                    [p for _, p in params], round(bucket_mb * MIB), round(first_bucket_mb * MIB)
                )
                self._reducers.append(
                    GradReducer(params, comm, buckets, find_unused_parameters=False, wire_dtype=None)
                )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        for reducer in self._reducers:
            reducer.prepare(self._require_sync)
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally; the next synchronised one averages the sum."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous
