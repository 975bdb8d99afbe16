"""Fused π kernels: the same arithmetic as :mod:`meshwise.workloads.pi`, compiled into one loop.

The eager kernels run ~17 tensor passes per chunk, so they are bound by memory traffic (~270 bytes moved
per Monte Carlo sample). ``torch.compile`` fuses the counter, the SplitMix64 mix, the hit test and the
sum into one generated loop (C++ on CPU, a Triton kernel on CUDA) in which the random numbers live only
in registers: nothing of size N — not even the chunk — is materialised.

Every chunk has the same static size and a tensor holding how many of its items are valid, and the
stream key, first index and bin width enter as tensors, so one compilation serves every chunk, seed and
N (the last, partial chunk is masked rather than recompiled). Results are bit-identical to the eager
kernels for Monte Carlo (integer arithmetic) and equal to rounding for the midpoint sum.
"""

from __future__ import annotations

from functools import cache

import torch

from meshwise.workloads.counter_rng import _MIX1, _MIX2, GOLDEN_GAMMA, _signed, stream_key

_COORD_BITS = 30


def _lsr(z: torch.Tensor, bits: int) -> torch.Tensor:
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _hits_chunk(first: torch.Tensor, valid: torch.Tensor, key: torch.Tensor, size: int) -> torch.Tensor:
    index = torch.arange(size, dtype=torch.int64, device=first.device)
    z = (index + first + 1) * _signed(GOLDEN_GAMMA) + key
    z = (z ^ _lsr(z, 30)) * _signed(_MIX1)
    z = (z ^ _lsr(z, 27)) * _signed(_MIX2)
    z = z ^ _lsr(z, 31)
    x = 2 * _lsr(z, 64 - _COORD_BITS) + 1
    y = 2 * (z & ((1 << _COORD_BITS) - 1)) + 1
    inside = (x * x + y * y < (1 << (2 * _COORD_BITS + 2))) & (index < valid)
    return inside.sum(dtype=torch.int64)


def _midpoint_chunk(first: torch.Tensor, valid: torch.Tensor, h: torch.Tensor, size: int) -> torch.Tensor:
    index = torch.arange(size, dtype=torch.int64, device=first.device)
    x = ((index + first).to(torch.float64) + 0.5) * h
    f = torch.where(index < valid, 1.0 / (1.0 + x * x), torch.zeros_like(x))
    return f.sum(dtype=torch.float64)


@cache
def _compiled(name: str):
    kernel = {"hits": _hits_chunk, "midpoint": _midpoint_chunk}[name]
    return torch.compile(kernel, dynamic=False, fullgraph=True)


def default_fused_chunk(device: torch.device) -> int:
    """Items per fused call: nothing is stored per item, so chunks only bound the launch count."""
    return 1 << 30 if device.type == "cuda" else 1 << 20


def _scalar(value: int | float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype, device=device)


def montecarlo_hits_fused(
    start: int, count: int, seed: int, *, device: torch.device | str = "cpu", chunk: int | None = None
) -> int:
    """:func:`~meshwise.workloads.pi.montecarlo_hits` through the compiled kernel (same result)."""
    device = torch.device(device)
    chunk = chunk or default_fused_chunk(device)
    kernel = _compiled("hits")
    key = _scalar(_signed(stream_key(seed)), torch.int64, device)
    hits = torch.zeros((), dtype=torch.int64, device=device)
    for first in range(start, start + count, chunk):
        valid = min(chunk, start + count - first)
        hits += kernel(_scalar(first, torch.int64, device), _scalar(valid, torch.int64, device), key, chunk)
    return int(hits.item())


def midpoint_partial_fused(
    start: int, count: int, n: int, *, device: torch.device | str = "cpu", chunk: int | None = None
) -> float:
    """:func:`~meshwise.workloads.pi.midpoint_partial` through the compiled kernel (equal to rounding)."""
    device = torch.device(device)
    chunk = chunk or default_fused_chunk(device)
    kernel = _compiled("midpoint")
    h = _scalar(1.0 / n, torch.float64, device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for first in range(start, start + count, chunk):
        valid = min(chunk, start + count - first)
        total += kernel(_scalar(first, torch.int64, device), _scalar(valid, torch.int64, device), h, chunk)
    return float(total.item()) * 4.0 / n
