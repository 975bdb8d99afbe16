"""Message sizes as people write them (``8``, ``4K``, ``64M``, ``1G``) and the sweeps built from them.

Suffixes are binary (K = 1024 B), as in nccl-tests' ``-b/-e`` options; a size is always a byte count.
Fractions are accepted as nccl-tests accepts them (``1.5K`` = 1536 B) and rounded down to whole bytes.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``8``, ``4K``, ``1.5K``, ``4KiB``, ``64M`` or ``1G`` (binary units, rounded down)."""
    match = _PATTERN.match(text)
    if match is None:
        raise ValueError(f"size {text!r} is not understood; write bytes like 8, 1.5K, 64M or 1G")
    number, unit = match.group(1), match.group(2).upper()
    whole, _, fraction = number.partition(".")
    # Exact arithmetic: a float would turn 1.1T into a byte count one off.
    scale = _UNITS[unit]
    fraction_bytes = int(fraction) * scale // 10 ** len(fraction) if fraction else 0
    return int(whole or 0) * scale + fraction_bytes


def format_size(nbytes: int) -> str:
    """The shortest exact spelling of ``nbytes`` (``4096`` → ``4K``), the inverse of :func:`parse_size`."""
    for unit in ("T", "G", "M", "K"):
        scale = _UNITS[unit]
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def size_sweep(
    minimum: int, maximum: int, *, factor: int | None = None, step: int | None = None
) -> list[int]:
    """Sizes from ``minimum`` to ``maximum`` (inclusive) multiplying by ``factor`` or adding ``step``.

    Exactly one of ``factor`` (≥ 2) and ``step`` (≥ 1) is used, as nccl-tests' ``-f``/``-i`` (whose
    ``-f 1`` means "no factor, add -i": the CLI maps it to ``factor=None``).
    """
    if minimum < 1:
        raise ValueError(f"minimum size must be at least 1 byte, got {minimum}")
    if maximum < minimum:
        raise ValueError(f"maximum size {maximum} B is below the minimum {minimum} B; swap -b and -e")
    if (factor is None) == (step is None):
        raise ValueError("give exactly one of a multiplication factor (-f) and an increment (-i)")
    if factor is not None and factor < 2:
        raise ValueError(f"-f must be an integer factor of at least 2, got {factor}")
    if step is not None and step < 1:
        raise ValueError(f"-i must be a positive number of bytes, got {step}")
    sizes = []
    size = minimum
    while size <= maximum:
        sizes.append(size)
        size = size * factor if factor is not None else size + step
    return sizes
