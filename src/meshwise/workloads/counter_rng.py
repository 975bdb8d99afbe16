"""A counter-based random stream: sample ``i`` of seed ``s`` is a pure function of ``(s, i)``.

Why counter-based: a Monte Carlo job split over any number of ranks must draw exactly the same points, so
the random number of a sample may depend only on its *global* index, never on which rank computes it or
how many came before on that rank. SplitMix64 (Steele, Lea & Flood, OOPSLA 2014) has this form: its state
after ``i`` steps is ``key + (i + 1)·γ`` and its output is a bijective 64-bit mix of that state, so the
stream can be entered at any index in O(1).

The torch version uses only int64 add/multiply/xor/shift, which wrap modulo 2**64 identically on CPU and
CUDA; logical right shifts are an arithmetic shift followed by a mask. A pure-Python reference with
explicit ``& MASK64`` checks the torch kernels bit for bit.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(value: int) -> int:
    """The int64 with the same 64 bits as the unsigned ``value`` (torch has no uint64 arithmetic)."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def mix64_reference(z: int) -> int:
    """SplitMix64's output function on an unsigned 64-bit integer (the reference for the torch kernel)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & MASK64
    return z ^ (z >> 31)


def stream_key(seed: int) -> int:
    """The stream origin for ``seed``: mixed, so nearby seeds give unrelated streams."""
    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed}")
    return mix64_reference(seed * GOLDEN_GAMMA)


def random_bits_reference(key: int, index: int) -> int:
    """Unsigned 64-bit random value number ``index`` of the stream ``key`` (pure Python)."""
    return mix64_reference(key + (index + 1) * GOLDEN_GAMMA)


def _logical_shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def random_bits(key: int, first: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Values ``first .. first+count-1`` of the stream ``key`` as int64 tensors holding the 64 raw bits.

    Works in place on one buffer, so a chunk costs ``8·count`` bytes however long the stream is.
    """
    z = torch.arange(first + 1, first + 1 + count, dtype=torch.int64, device=device)
    z.mul_(_signed(GOLDEN_GAMMA)).add_(_signed(key))
    z.bitwise_xor_(_logical_shift_right(z, 30)).mul_(_signed(_MIX1))
    z.bitwise_xor_(_logical_shift_right(z, 27)).mul_(_signed(_MIX2))
    return z.bitwise_xor_(_logical_shift_right(z, 31))
