"""π by the midpoint rule and by Monte Carlo sampling: the kernels, the work split and the result.

Both are the seeds' hands-on exercises. The work (bins or samples) is split into contiguous ranges of the
global index space, and every quantity is a pure function of the global index, so the total is the same
whatever the number of ranks: exactly for Monte Carlo hit counts, to rounding for the midpoint sum.

Remainder rule: with ``n`` items on ``p`` ranks, rank ``r`` gets ``n // p + 1`` items if ``r < n % p`` and
``n // p`` otherwise, starting at ``r·(n // p) + min(r, n % p)``. The first ranks take one extra item, so
loads differ by at most one item and the ranges tile ``[0, n)`` in rank order.

Memory is bounded by the chunk size, never by ``n``: a chunk of ``c`` items costs a few ``8·c``-byte
buffers, reused for every chunk of the range (``n`` = 10**13 runs in the same memory as ``n`` = 10**6).
"""

from __future__ import annotations

import math

import torch

from meshwise.workloads.counter_rng import random_bits, stream_key

#: Largest accepted work size: midpoint abscissae i + 0.5 stay exact in float64 up to 2**53.
MAX_ITEMS = 2**53
#: Monte Carlo coordinates are 30-bit integers; a point hits when (2x+1)² + (2y+1)² < 2**62, i.e. the
#: centre of its lattice cell lies inside the quarter circle. Integer-exact on every device.
_COORD_BITS = 30
_COORD_MASK = (1 << _COORD_BITS) - 1
_RADIUS_SQUARED = 1 << (2 * _COORD_BITS + 2)
METHODS = ("midpoint", "montecarlo")
#: Peak bytes per item of one eager chunk, with margin: measured 24 (Monte Carlo: the raw bits, a shift
#: temporary and x) and 8 (midpoint, computed in one reused buffer) on CPU with a 2**24-item chunk.
EAGER_BYTES_PER_ITEM = {"montecarlo": 32, "midpoint": 16}


def check_work(n: int, what: str = "N") -> int:
    """Refuse a work size that is not a positive integer within range, saying what to pass instead."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{what} must be an integer number of samples/bins, got {n!r}")
    if n <= 0:
        raise ValueError(f"{what} must be a positive number of samples/bins, got {n}")
    if n > MAX_ITEMS:
        raise ValueError(f"{what}={n} exceeds the supported maximum 2**53 = {MAX_ITEMS}; use a smaller N")
    return n


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, count)`` of part ``index`` of ``n`` items cut into ``parts`` contiguous ranges.

    The first ``n % parts`` parts hold one extra item (see the module docstring).
    """
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"part {index} of {parts} does not exist")
    base, extra = divmod(n, parts)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


def default_chunk(device: torch.device) -> int:
    """Items per chunk: cache-sized on CPU, large on GPUs so kernel launches are amortised."""
    return 1 << 25 if device.type == "cuda" else 1 << 16


def midpoint_partial(
    start: int, count: int, n: int, *, device: torch.device | str = "cpu", chunk: int | None = None
) -> float:
    """Σ 4/(1+x_i²)·h over bins ``start .. start+count-1`` of ``n``, x_i = (i + ½)·h, h = 1/n."""
    device = torch.device(device)
    chunk = chunk or default_chunk(device)
    h = 1.0 / n
    total = torch.zeros((), dtype=torch.float64, device=device)
    buffer = torch.empty(min(chunk, max(count, 1)), dtype=torch.float64, device=device)
    for first in range(start, start + count, chunk):
        size = min(chunk, start + count - first)
        x = torch.arange(first, first + size, dtype=torch.float64, device=device, out=buffer[:size])
        x.add_(0.5).mul_(h)
        x.mul_(x).add_(1.0).reciprocal_()
        total += x.sum()
    return float(total.item()) * 4.0 * h


def montecarlo_hits(
    start: int, count: int, seed: int, *, device: torch.device | str = "cpu", chunk: int | None = None
) -> int:
    """How many of samples ``start .. start+count-1`` of stream ``seed`` fall inside the quarter circle."""
    device = torch.device(device)
    chunk = chunk or default_chunk(device)
    key = stream_key(seed)
    hits = torch.zeros((), dtype=torch.int64, device=device)
    for first in range(start, start + count, chunk):
        size = min(chunk, start + count - first)
        bits = random_bits(key, first, size, device)
        x = (bits >> (64 - _COORD_BITS)) & _COORD_MASK
        y = bits.bitwise_and_(_COORD_MASK)
        x.mul_(2).add_(1)
        y.mul_(2).add_(1)
        x.mul_(x).add_(y.mul_(y))
        hits += torch.count_nonzero(x < _RADIUS_SQUARED)
    return int(hits.item())


def estimate_from_hits(hits: int, samples: int) -> tuple[float, float]:
    """``(π̂, standard error)`` with π̂ = 4·hits/samples and SE = 4·√(p(1−p)/samples), p = hits/samples."""
    p = hits / samples
    return 4.0 * p, 4.0 * math.sqrt(p * (1.0 - p) / samples)
