"""Memory checked before work starts: a job that cannot fit is refused with what to lower.

The kernel's OOM killer ends an oversized run after minutes with no hint (a 16 GiB shared-memory
benchmark was killed after 41 s); comparing an estimate of the job's need with what this machine has
available turns that into one line before any rank starts. Estimates are per command (they know their
buffers); this module only reads the machine and phrases the refusal.
"""

from __future__ import annotations

GIB = 2**30


def available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes the kernel says can be allocated without swapping (``MemAvailable``); None if unknown."""
    try:
        with open(meminfo) as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_memory(need: int, what: str, advice: str, available: int | None = None) -> None:
    """Raise ValueError when ``need`` bytes exceed the available memory (unknown: no check).

    ``what`` names the work (``"all_reduce of 16 GiB on 2 ranks"``), ``advice`` the options to lower.
    """
    have = available_memory() if available is None else available
    if have is not None and need > have:
        raise ValueError(
            f"{what} needs about {need / GIB:.1f} GiB of memory, this machine has {have / GIB:.1f} GiB "
            f"available; {advice}"
        )
