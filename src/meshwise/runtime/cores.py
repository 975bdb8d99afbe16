"""How many CPU cores this process may use, and how to share them among local ranks.

Several ranks on one host that each start torch's default thread pool (one thread per core) oversubscribe
the machine: measured here, two ranks with two threads each made a 1 MiB all_reduce 10–50× slower than
with one thread each. Every launcher in meshwise therefore gives each local rank its share of the cores.
"""

from __future__ import annotations

import os


def available_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_rank(local_ranks: int) -> int:
    """This host's cores divided among ``local_ranks`` ranks, at least one each."""
    return max(1, available_cores() // max(1, local_ranks))
