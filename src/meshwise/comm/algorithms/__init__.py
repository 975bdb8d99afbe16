"""Collective algorithms built from point-to-point messages, as plans an executor runs.

=============  ===================================================================  =======================
algo           collectives it implements (the others use the base's own)             steps (p ranks)
=============  ===================================================================  =======================
ring           all_reduce (pipelined RS + AG), reduce_scatter, all_gather           2(p−1), p−1, p−1
tree           broadcast, reduce, scatter, gather (binomial); all_reduce (R + B)    ⌈lg p⌉ (all_reduce ×2)
rd             all_reduce, all_gather (recursive doubling)                          lg p (+2 folding)
rhd            all_reduce, reduce_scatter (Rabenseifner)                            2 lg p, lg p (+2)
pairwise       all_to_all                                                           p−1
linear         every collective, all messages at once                               1 round, p−1 messages
hierarchical   all_reduce (intra RS → inter all_reduce → intra AG)                   see cost.py
auto           per call, the cheapest by :mod:`meshwise.comm.cost` (native too)     —
native         the base communicator unchanged                                       —
=============  ===================================================================  =======================
"""

from meshwise.comm.algorithms.catalog import build_plan
from meshwise.comm.algorithms.communicator import (
    ALGORITHMS,
    DEFAULT_SEGMENT_BYTES,
    AlgorithmCommunicator,
    with_algorithm,
)
from meshwise.comm.algorithms.executor import execute
from meshwise.comm.algorithms.plan import Copy, Fence, Plan, Recv, Reduce, Region, Send

__all__ = [
    "ALGORITHMS",
    "DEFAULT_SEGMENT_BYTES",
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
    "with_algorithm",
]
