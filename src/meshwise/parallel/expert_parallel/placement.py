"""Where expert-parallel parameters live: ep ranks are carved from the data-parallel ranks, and within an
ep group the E experts of every MoE layer are split into contiguous blocks of E/ep, everything else
replicated (how their gradients average: :mod:`~meshwise.parallel.expert_parallel.data_parallel`).
"""

from __future__ import annotations

from torch import nn

from meshwise.comm.api import Communicator
from meshwise.parallel.expert_parallel.exchange import AllToAllExchange
from meshwise.parallel.protocols import expert_layers


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
    """Keep only this rank's experts in every expert layer of ``model`` and route through ``ep_comm``.

    ``model`` must be built identically on every ep rank (same seed): the experts kept are then the
    one-process model's, under the same parameter names. Returns ``model``, changed in place.
    """
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
