"""Where each parameter lives once a group of parameters is flattened and cut into N equal shards.

ZeRO and FSDP lay a group's parameters end to end in one flat vector, pad it with zeros to a multiple of
the world size N, and give rank r the contiguous slice ``[r·s, (r+1)·s)`` with ``s = ⌈Ψ/N⌉``. Equal slices
are what make the collectives cheap (one all-gather or reduce-scatter with even slots, no per-rank size
exchange); padding is what makes every N work, whatever Ψ is. The padding costs at most N − 1 elements per
group and stays zero forever: its gradient is zero, so no optimizer moves it.

This module is plain data: it only knows element counts, so the piece bookkeeping that sharded
checkpoints rely on is tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that falls inside one rank's shard."""

    param: int  # index of the parameter in its group
    param_start: int  # element offset inside the flattened parameter
    shard_start: int  # element offset inside the rank's shard
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    """A group of parameters (element counts, in order) flattened and sharded over ``world_size`` ranks."""

    numels: tuple[int, ...]
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be at least 1, got {self.world_size}")
        if not self.numels or any(n < 0 for n in self.numels):
            raise ValueError(f"a flat group needs parameters with non-negative sizes, got {self.numels}")

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Element offset of each parameter in the flat vector."""
        offsets, total = [], 0
        for n in self.numels:
            offsets.append(total)
            total += n
        return tuple(offsets)

    @property
    def numel(self) -> int:
        """Ψ of the group: its elements without padding."""
        return sum(self.numels)

    @property
    def shard_numel(self) -> int:
        """Elements per rank, ⌈Ψ/N⌉ (at least one, so an empty group still has a shard to gather)."""
        return max(1, -(-self.numel // self.world_size))

    @property
    def padded_numel(self) -> int:
        """N · shard: the flat vector's length with padding."""
        return self.shard_numel * self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, rank: int) -> list[Piece]:
        """The parameters' parts inside ``rank``'s shard, in flat order (padding is in none of them)."""
        start, end = self.shard_range(rank)
        pieces = []
        for index, (offset, n) in enumerate(zip(self.offsets, self.numels, strict=True)):
            low, high = max(start, offset), min(end, offset + n)
            if low < high:
                pieces.append(Piece(index, low - offset, low - start, high - low))
        return pieces
