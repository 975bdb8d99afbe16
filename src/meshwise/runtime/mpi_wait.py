"""Bounded waits on MPI requests, shared by the MPI bootstrap and the ``mpi`` Communicator.

``MPI_Wait`` blocks forever when a peer never posts its side, and MPI offers no timeout of its own, so
meshwise never calls it: requests are polled with ``MPI_Testall`` (which also drives Open MPI's progress
engine) until they complete or a deadline passes. For the first 2 ms the loop polls back to back but
yields the core between polls (``sched_yield``), so small messages see microsecond latency and a peer
rank sharing the core still runs; after that the pause between polls grows from 10 µs to 1 ms, so a long
wait does not burn a core. (Spinning without yielding measured many times slower on an oversubscribed host.)
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

_SPIN_S = 2e-3
_FIRST_PAUSE_S = 1e-5
_LONGEST_PAUSE_S = 1e-3


def import_mpi() -> Any:
    """``mpi4py.MPI`` (importing it initialises MPI), or an ImportError that says how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(
            f"the MPI features need mpi4py ({exc}); install them with `pip install 'meshwise[mpi]'` "
            "(mpi4py + the Open MPI wheel), or `pip install mpi4py` against your system MPI"
        ) from None
    return MPI


def all_done(requests: Sequence[Any], statuses: list[Any] | None = None) -> bool:
    """One non-blocking completion check of every request (an empty list is complete)."""
    if not requests:
        return True
    if len(requests) == 1:  # Test raises the request's own error class (Testall only ERR_IN_STATUS)
        return bool(requests[0].Test(statuses[0] if statuses else None))
    MPI = import_mpi()
    return bool(MPI.Request.Testall(list(requests), statuses))


def wait_all(requests: Sequence[Any], timeout: float, statuses: list[Any] | None = None) -> bool:
    """Poll until every request completed (True) or ``timeout`` seconds passed (False).

    MPI errors (a truncated message, a failed peer that the library detects) propagate as
    ``MPI.Exception`` for the caller to translate.
    """
    start = time.monotonic()
    deadline = start + timeout
    spin_until = start + _SPIN_S
    pause = _FIRST_PAUSE_S
    while not all_done(requests, statuses):
        now = time.monotonic()
        if now >= deadline:
            return False
        if now < spin_until:
            os.sched_yield()  # give the core to a peer rank if one is waiting for it (oversubscription)
        else:
            time.sleep(pause)
            pause = min(pause * 2, _LONGEST_PAUSE_S)
    return True
