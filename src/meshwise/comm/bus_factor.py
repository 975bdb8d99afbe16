"""nccl-tests' bus factor: from a message size S to the bytes one rank's link carries.

Written once here, below both users: ``meshwise bench`` turns algbw into busbw with it, and the counting
Communicator turns counted bytes into link traffic with it, so the two always agree (nccl-tests,
doc/PERFORMANCE.md): 2(n−1)/n for all_reduce, (n−1)/n for the collectives that cut the buffer into one
slot per rank, 1 for the rest (a rooted copy, point-to-point, a barrier of no bytes).
"""

from __future__ import annotations

from meshwise.comm.api import Collective

#: Collectives whose buffer is cut into one slot per rank.
SLOTTED = frozenset({"all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"})
#: Operations that move the buffer once, whole.
WHOLE = frozenset({"broadcast", "reduce", "sendrecv", "send", "recv", "barrier"})


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw for ``op`` (a :class:`Collective` or its name) on ``world_size`` ranks."""
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    n = world_size
    name = op.value if isinstance(op, Collective) else op
    if name == "all_reduce":
        return 2.0 * (n - 1) / n
    if name in SLOTTED:
        return (n - 1) / n
    if name in WHOLE:
        return 1.0
    known = ", ".join(["all_reduce", *sorted(SLOTTED | WHOLE)])
    raise ValueError(f"unknown collective {name!r}; choose one of {known}")
