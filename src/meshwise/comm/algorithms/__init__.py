"""Collective algorithms built from point-to-point messages, as plans an executor runs.

Which algorithm implements which collective, with which plan and at what cost, is written once, in
:mod:`~meshwise.comm.algorithms.registry` (``print(reference_table())`` shows it); ``auto`` chooses per
call by :mod:`~meshwise.comm.algorithms.choice`, and :mod:`~meshwise.comm.algorithms.simulate` runs
every rank's plan in one process to prove it correct.
"""

from meshwise.comm.algorithms.plan import Copy, Fence, Plan, Recv, Reduce, Region, Send
from meshwise.comm.algorithms.registry import ALGORITHMS, REGISTRY, build_plan, reference_table
from meshwise.lazy import lazy_names

# lazily: plans and the registry are torch-free (the planner prices with them); running a plan is not
__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "meshwise.comm.algorithms.communicator": (
            "DEFAULT_SEGMENT_BYTES",
            "AlgorithmCommunicator",
            "with_algorithm",
        ),
        "meshwise.comm.algorithms.executor": ("execute",),
    },
)

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
