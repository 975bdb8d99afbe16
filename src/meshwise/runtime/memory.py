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
    return _kib_field(meminfo, "MemAvailable:")


def peak_resident_bytes(status: str = "/proc/self/status") -> int | None:
    """This process's peak resident set so far (``VmHWM``), for benchmarks' per-rank peak memory on a
    CPU; None where the kernel does not say."""
    return _kib_field(status, "VmHWM:")


def _kib_field(path: str, key: str) -> int | None:
    """The ``key: N kB`` line of a /proc file, in bytes; None if it is missing or unreadable."""
    try:
        with open(path) as handle:
            for line in handle:
                if line.startswith(key):
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


#: GPU memory a rank needs besides its own buffers: NCCL's communication buffers (NCCL_BUFFSIZE, 4 MiB
#: by default, per channel and peer) and the allocator's rounding; a sweep that only just fits the
#: buffers would still fail.
NCCL_RESERVE = 512 * 2**20


def free_device_memory(devices: list[int]) -> dict[int, int]:
    """Free bytes on each CUDA device index (``torch.cuda.mem_get_info``), read before any rank starts.

    Reading creates this process's CUDA context on each device, so a rank started by a launcher asks
    about its own device only.
    """
    import torch  # runtime/ reads the machine; torch only where CUDA is asked about

    return {index: int(torch.cuda.mem_get_info(index)[0]) for index in devices}


def check_device_memory(need: int, free: dict[int, int], what: str, advice: str) -> None:
    """Raise ValueError when ``need`` bytes (per rank, one rank per device) exceed the free memory of
    the fullest device in ``free`` (index -> bytes), naming it."""
    if not free:
        return
    index = min(free, key=free.__getitem__)
    if need > free[index]:
        raise ValueError(
            f"{what} needs about {need / GIB:.1f} GiB on each GPU, cuda:{index} has {free[index] / GIB:.1f} "
            f"GiB free; {advice}"
        )
