"""How long one wait may take, and how a job's overall deadline maps onto it: written once.

A command's ``--timeout`` bounds the whole job (a π run or a training may take hours), but no single wait
of a Communicator or a rendezvous should: a dead or mismatched peer must be named within minutes.
"""

from __future__ import annotations

#: the default bound on one wait of a Communicator, ``meshwise.init`` or the MPI rendezvous: long enough
#: for a slow first connection or a checkpoint written by a peer, short enough to name a dead peer soon
DEFAULT_TIMEOUT_S = 300.0


def wait_timeout(deadline: float | None) -> float:
    """The bound on each wait within a job that may take ``deadline`` seconds in all (None: no
    deadline, which leaves the hang timeout at its default)."""
    return DEFAULT_TIMEOUT_S if deadline is None else min(deadline, DEFAULT_TIMEOUT_S)
