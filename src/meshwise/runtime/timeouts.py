"""How long one wait may take, and how a job's overall deadline maps onto it: written once.

A command's ``--timeout`` bounds the whole job (a π run or a training may take hours), but no single wait
of a Communicator or a rendezvous should: a dead or mismatched peer must be named within minutes.
"""

from __future__ import annotations

from meshwise.runtime.flight_dumps import DUMP_WAIT_SECONDS

#: the default bound on one wait of a Communicator, ``meshwise.init`` or the MPI rendezvous: long enough
#: for a slow first connection or a checkpoint written by a peer, short enough to name a dead peer soon
DEFAULT_TIMEOUT_S = 300.0


def wait_timeout(deadline: float | None) -> float:
    """The bound on each wait within a job that may take ``deadline`` seconds in all (None: no
    deadline, which leaves the hang timeout at its default).

    A wait that starts right after the job does must not time out while the passed deadline is still
    collecting the ranks' flight records (up to :data:`DUMP_WAIT_SECONDS`): the deadline's report says
    which rank waits where, and a rank whose wait had failed meanwhile would read as failed, not hung. So
    each wait outlives the deadline by that much (capped at the default)."""
    return DEFAULT_TIMEOUT_S if deadline is None else min(deadline + DUMP_WAIT_SECONDS, DEFAULT_TIMEOUT_S)
