"""Collective algorithms built from point-to-point messages, as plans an executor runs.

Which algorithm implements which collective, with which plan and at what cost, is written once, in
:mod:`~meshwise.comm.algorithms.registry` (``print(reference_table())`` shows it); ``auto`` chooses per
call by :mod:`~meshwise.comm.algorithms.choice`, and :mod:`~meshwise.comm.algorithms.simulate` runs
every rank's plan in one process to prove it correct.
"""

from meshwise.comm.algorithms.communicator import (
    DEFAULT_SEGMENT_BYTES,
    AlgorithmCommunicator,
    with_algorithm,
)
from meshwise.comm.algorithms.executor import execute
from meshwise.comm.algorithms.plan import Copy, Fence, Plan, Recv, Reduce, Region, Send
from meshwise.comm.algorithms.registry import ALGORITHMS, REGISTRY, build_plan, reference_table

__all__ = [
    "ALGORITHMS",
    "DEFAULT_SEGMENT_BYTES",
    "REGISTRY",
    "AlgorithmCommunicator",
    "Copy",
    "Fence",
    "Plan",
    "Recv",
    "Reduce",
    "Region",
    "Send",
    "build_plan",
    "execute",
    "reference_table",
    "with_algorithm",
]
