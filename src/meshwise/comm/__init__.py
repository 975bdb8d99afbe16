"""Communication: the Communicator protocol, its backends, collective algorithms and their cost model."""

from meshwise.comm.api import (
    CollectiveMismatchError,
    CommError,
    CommTimeoutError,
    Communicator,
    PeerFailureError,
    ReduceOp,
    Work,
)
from meshwise.comm.factory import create_communicator

__all__ = [
    "CollectiveMismatchError",
    "CommError",
    "CommTimeoutError",
    "Communicator",
    "PeerFailureError",
    "ReduceOp",
    "Work",
    "create_communicator",
]
