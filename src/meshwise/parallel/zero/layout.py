"""Where each parameter lives once a group of parameters is flattened and cut into N equal shards, and
a shard's range of a parameter as the rectangles a checkpoint can name.

ZeRO and FSDP lay a group's parameters end to end in one flat vector, pad it with zeros to a multiple of
the world size N, and give rank r the contiguous slice ``[r·s, (r+1)·s)`` with ``s = ⌈Ψ/N⌉``. Equal slices
are what make the collectives cheap (one all-gather or reduce-scatter with even slots, no per-rank size
exchange); padding is what makes every N work, whatever Ψ is. The padding costs at most N − 1 elements per
group and stays zero forever: its gradient is zero, so no optimizer moves it.

A shard cuts a parameter at arbitrary element offsets, but a checkpoint that other layouts read must
store the parameter in its own shape. The elements ``[start, end)`` of a row-major tensor of shape
``(R, C, ...)`` are a partial first row, whole middle rows and a partial last row; each partial row is the
same problem one dimension down. So a 2-D range is at most three boxes and an N-d range at most
``2·N − 1``, each described by offsets and sizes per dimension.

Plain data: element counts and shapes in, integers out, tested without processes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import NamedTuple


class Piece(NamedTuple):
    """The part of one parameter that falls inside one rank's shard."""

    param: int  # index of the parameter in its group
    param_start: int  # element offset inside the flattened parameter
    shard_start: int  # element offset inside the rank's shard
    numel: int


class Box(NamedTuple):
    """One rectangular piece of a tensor: where it starts, how big it is, and where its elements begin in
    the flat (row-major) order — they are the contiguous run ``[flat_start, flat_start + numel)``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class FlatLayout:
    """A group of parameters (element counts, in order) flattened and sharded over ``world_size`` ranks."""

    numels: tuple[int, ...]
    world_size: int

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Element offset of each parameter in the flat vector."""
        return tuple(accumulate(self.numels[:-1], initial=0))

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
        return self.shard_numel * self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
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


def boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """The boxes, in flat order, that cover exactly the elements ``[start, end)`` of a tensor of ``shape``."""
    shape = tuple(int(s) for s in shape)
    if not 0 <= start <= end <= math.prod(shape):
        raise ValueError(
            f"element range [{start}, {end}) is outside shape {shape} ({math.prod(shape)} elements)"
        )
    return _split(shape, start, end)


def _split(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    if start >= end:
        return []
    if len(shape) <= 1:  # a scalar (one element) or a run along the only dimension
        return [Box((start,) * len(shape), (end - start,) * len(shape), start)]
    rest, inner = shape[1:], math.prod(shape[1:])
    first, last = start // inner, (end - 1) // inner
    if first == last:  # inside one row: the problem one dimension down
        return _in_row(rest, first, start - first * inner, end - first * inner, inner)
    out = []
    whole_from, whole_to = -(-start // inner), end // inner  # rows entirely inside [start, end)
    if start % inner:
        out += _in_row(rest, first, start % inner, inner, inner)
    if whole_from < whole_to:
        out.append(Box((whole_from,) + (0,) * len(rest), (whole_to - whole_from, *rest), whole_from * inner))
    if end % inner:
        out += _in_row(rest, whole_to, 0, end % inner, inner)
    return out


def _in_row(rest: tuple[int, ...], row: int, start: int, end: int, inner: int) -> list[Box]:
    """Boxes of ``[start, end)`` inside row ``row`` (a tensor of shape ``rest``), lifted to the full rank."""
    return [
        Box((row, *b.offsets), (1, *b.sizes), row * inner + b.flat_start) for b in _split(rest, start, end)
    ]
