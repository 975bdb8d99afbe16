"""Where expert-parallel parameters live, and over which ranks their gradients average.

ep ranks are carved from the data-parallel ranks: within an ep group the E experts of every MoE layer are
split into contiguous blocks of E/ep, everything else replicated. So a rank's dense weights are the same on
every rank of ``mesh.replicas`` (dp·ep·cp) and its experts on every rank of ``mesh.expert_replicas``
(dp·cp): :func:`replica_groups` splits the parameters into those two groups, once for
:class:`~meshwise.parallel.DataParallel` (``experts=``) and a pipeline stage's reducers alike.

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
from meshwise.parallel.expert_parallel.exchange import AllToAllExchange
from meshwise.parallel.protocols import expert_layers

NamedParameters = list[tuple[str, nn.Parameter]]
_DIVIDED = "_meshwise_divided_by_ep"  # set on an expert parameter whose gradient hook divides by ep


def check_expert_parallel(experts: int, ep: int) -> None:
    """A ValueError naming what to change when E experts cannot be spread over ``ep`` ranks."""
    if ep < 1:
        raise ValueError(f"--ep must be at least 1, got {ep}")
    if ep > 1 and experts < 1:
        raise ValueError(f"--ep {ep} spreads experts over ranks: give the model experts (--experts E)")
    if ep > 1 and experts % ep:
        divisors = [d for d in range(1, experts + 1) if experts % d == 0]
        raise ValueError(
            f"--experts {experts} is not divisible by --ep {ep}: every ep rank holds E/ep experts; choose "
            f"--ep in {divisors} or a multiple of {ep} experts"
        )


def local_experts(experts: int, ep: int, ep_rank: int) -> range:
    """The global indices of the experts ep rank ``ep_rank`` holds: a contiguous block of E/ep."""
    per_rank = experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def apply_expert_parallel(model: nn.Module, ep_comm: Communicator) -> nn.Module:
    """Keep only this rank's experts in every expert layer of ``model`` (in place) and route through
    ``ep_comm``. Built identically on every ep rank (same seed), the experts kept are the one-process
    model's, under the same parameter names."""
    for layer in expert_layers(model):
        check_expert_parallel(layer.num_experts, ep_comm.world_size)
        mine = {str(e) for e in local_experts(layer.num_experts, ep_comm.world_size, ep_comm.rank)}
        for name in [name for name in layer.experts if name not in mine]:
            del layer.experts[name]
        layer.exchange = AllToAllExchange(ep_comm, layer.num_experts)
    return model


def is_expert_parameter(name: str) -> bool:
    """Whether a parameter (by its name in the model) belongs to one expert (and is sharded over ep)."""
    return ".experts." in f".{name}"


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
