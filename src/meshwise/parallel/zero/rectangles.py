"""A flat element range of a tensor as the few rectangular boxes that cover it exactly.

A ZeRO shard cuts a parameter at arbitrary element offsets, but a checkpoint that other layouts (plain
data parallelism, tensor parallelism) read must store the parameter in its own shape. The elements
``[start, end)`` of a row-major tensor of shape ``(R, C, ...)`` are a partial first row, whole middle
rows and a partial last row; each partial row is the same problem one dimension down. So a 2-D range
is at most three boxes and an N-d range at most ``2·N − 1``, each of which ``torch.distributed``'s
sharded tensors can describe (offsets and sizes per dimension).

Plain data: shapes and integers in, boxes out, tested without processes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    """One rectangular piece of a tensor: where it starts, how big it is, and where its elements begin in
    the flat (row-major) order — they are the contiguous run ``[flat_start, flat_start + numel)``."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """The boxes, in flat order, that cover exactly the elements ``[start, end)`` of a tensor of ``shape``."""
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if not 0 <= start <= end <= numel:
        raise ValueError(f"element range [{start}, {end}) is outside shape {shape} ({numel} elements)")
    return [Box(offsets, sizes, flat) for offsets, sizes, flat in _split(shape, start, end)]


_Raw = tuple[tuple[int, ...], tuple[int, ...], int]  # a Box's fields, before wrapping


def _split(shape: tuple[int, ...], start: int, end: int) -> list[_Raw]:
    if start >= end:
        return []
    if len(shape) <= 1:  # a scalar (one element) or a run along the only dimension
        return [((start,) * len(shape), (end - start,) * len(shape), start)]
    inner = math.prod(shape[1:])
    rest = shape[1:]
    first, last = start // inner, (end - 1) // inner
    if first == last:  # inside one row: the problem one dimension down
        return _in_row(rest, first, start - first * inner, end - first * inner, inner)
    out = []
    whole_from, whole_to = -(-start // inner), end // inner  # rows entirely inside [start, end)
    if start % inner:
        out += _in_row(rest, first, start % inner, inner, inner)
    if whole_from < whole_to:
        out.append(((whole_from,) + (0,) * len(rest), (whole_to - whole_from, *rest), whole_from * inner))
    if end % inner:
        out += _in_row(rest, whole_to, 0, end % inner, inner)
    return out


def _in_row(rest: tuple[int, ...], row: int, start: int, end: int, inner: int) -> list[_Raw]:
    """Boxes of ``[start, end)`` inside row ``row`` (a tensor of shape ``rest``), lifted to the full rank."""
    return [((row, *o), (1, *s), row * inner + f) for o, s, f in _split(rest, start, end)]
