"""Data parallelism for a model whose experts are spread over ``ep``: which ranks each gradient averages over.

Under ``--ep`` a rank's dense weights are the same on every rank of ``mesh.replicas`` (dp·ep·cp) and its
experts on every rank of ``mesh.expert_replicas`` (dp·cp), so :func:`replica_groups` splits the parameters
into those two groups, once for :class:`~meshwise.parallel.DataParallel` (``experts=``) and a pipeline
stage's reducers (:mod:`~meshwise.parallel.pipeline_parallel.stage_reducer`) alike.

An expert's gradient needs one more factor. Each rank's loss is the mean over its own tokens, and the
global loss is the mean of the D = |replicas| ranks' losses. The combine's backward all-to-all already
*sums* into each expert the gradients of the ep ranks' tokens routed to it, so the expert replicas' average
of those sums is ep times the global mean's gradient: a hook divides by ep as the gradient is produced
(before accumulation, so micro-batches under ``no_sync`` and the reducers see the right value, and a
split backward's weight pass, which adds its gradients through autograd, goes through it too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from meshwise.comm.api import Communicator
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
