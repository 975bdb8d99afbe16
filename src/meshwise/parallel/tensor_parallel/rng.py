"""Dropout randomness under tensor parallelism: equal masks where activations are replicated, different
masks where each rank holds different data.

The replicated residual stream's dropouts must draw the same mask on every rank or the replicas diverge
(:func:`share_cpu_random_state`). Attention-probability dropout (different heads per rank) and, under
sequence parallelism, the residual dropouts (different tokens) would reuse one pattern across ranks from
the shared state — valid, but correlated — so they draw from a :class:`RankRandomState` of the rank's own,
as Megatron-LM's model-parallel RNG tracker does. CPU only: on CUDA the default generator is used as is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from meshwise.comm.api import Communicator

_RANK_OFFSET = 2718  # keeps the rank states apart from the shared seed


def share_cpu_random_state(comm: Communicator) -> None:
    """Give every rank of ``comm`` its first rank's CPU random state (collective)."""
    state = torch.get_rng_state().to(torch.int64)
    comm.broadcast(state, 0)
    torch.set_rng_state(state.to(torch.uint8))


class RankRandomState:
    """A CPU random state per rank of ``comm``, seeded from one seed the group agrees on (collective)."""

    def __init__(self, comm: Communicator) -> None:
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        comm.broadcast(seed, 0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed.item()) + _RANK_OFFSET + comm.rank)
            self._state = torch.get_rng_state()

    def get_state(self) -> torch.Tensor:
        """The state the next draw starts from (activation recomputation replays it)."""
        return self._state.clone()

    def set_state(self, state: torch.Tensor) -> None:
        self._state = state.clone()

    @contextmanager
    def active(self) -> Iterator[None]:
        """Draw from this rank's state inside the block; the shared state is untouched."""
        outer = torch.get_rng_state()
        torch.set_rng_state(self._state)
        try:
            yield
        finally:
            self._state = torch.get_rng_state()
            torch.set_rng_state(outer)


class ShardDropout(nn.Dropout):
    """Dropout on data that differs across the ranks (sequence shards), from the rank's own state."""

    def __init__(self, p: float, random: RankRandomState) -> None:
        super().__init__(p)
        self.random = random

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        with self.random.active():
            return super().forward(x)
