"""Data parallelism for a model whose experts are spread over ``ep``: two reducers, one per kind of weight.

Under ``--ep`` a rank's dense (non-expert) weights are the same on every rank of ``mesh.replicas``
(dp·ep·cp) and its experts on every rank of ``mesh.expert_replicas`` (dp·cp), so their gradients average
over those groups — one :class:`~meshwise.parallel.data_parallel.reducer.GradReducer` each, bucketed and
overlapped with backward as :class:`~meshwise.parallel.DataParallel` is.

An expert's gradient needs one more factor. Each rank's loss is the mean over its own tokens, and the
global loss is the mean of the D = |replicas| ranks' losses. The combine's backward all-to-all already
*sums* into each expert the gradients of the ep ranks' tokens routed to it, so the expert replicas' average
of those sums is ep times the global mean's gradient: a hook divides by ep as the gradient is produced
(before accumulation, so micro-batches under ``no_sync`` and the reducers see the right value).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from meshwise.comm.api import Communicator
from meshwise.parallel.data_parallel.buckets import MIB, plan_buckets
from meshwise.parallel.data_parallel.reducer import GradReducer
from meshwise.parallel.expert_parallel.placement import is_expert_parameter


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
        dense = [(name, p) for name, p in named if not is_expert_parameter(name)]
        experts = [(name, p) for name, p in named if is_expert_parameter(name)]
        if ep > 1:
            for _, param in experts:
                param.register_hook(lambda grad: grad / ep)
        self._require_sync = True
        self._reducers: list[GradReducer] = []
        for params, comm in ((dense, replicas), (experts, expert_replicas)):
            _broadcast([p for _, p in params], comm)
            if comm.world_size > 1 and params:
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


@torch.no_grad()
def _broadcast(params: Sequence[torch.Tensor], comm: Communicator) -> None:
    """The group's first rank's values everywhere (the model is built alike on every rank; this makes
    it so even if the seeds were not), one flat broadcast."""
    if comm.world_size == 1 or not params:
        return
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    comm.broadcast(flat, 0)
    offset = 0
    for param in params:
        param.copy_(flat[offset : offset + param.numel()].view_as(param))
        offset += param.numel()
