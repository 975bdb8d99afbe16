"""Buffer layouts and bandwidths exactly as nccl-tests defines them.

nccl-tests reports for every collective a size ``S`` (the larger of the send and receive buffer of one
rank), the time ``t`` of one operation, the *algorithm bandwidth* ``algbw = S / t`` and the *bus
bandwidth* ``busbw = algbw · factor(n)``. The factor turns algbw into the traffic each rank's link carries
under an optimal algorithm, so busbw of every collective can be compared with the hardware's link
bandwidth, independently of the number of ranks (nccl-tests, doc/PERFORMANCE.md):

=====================================================  ==============  ====================================
collective                                             factor          S (bytes per rank)
=====================================================  ==============  ====================================
all_reduce                                             2(n−1)/n        the buffer reduced
all_gather                                             (n−1)/n         the gathered output (n slots)
reduce_scatter                                         (n−1)/n         the input (n slots)
all_to_all                                             (n−1)/n         the send buffer (n slots)
gather, scatter                                        (n−1)/n         the root's buffer (n slots)
broadcast, reduce, sendrecv                            1               the buffer sent
=====================================================  ==============  ====================================

The "count" column is the element count of the operation's parameter, as in nccl-tests: the whole buffer
for all_reduce/broadcast/reduce/sendrecv and one slot (S / n) for the slotted collectives. A requested
size is rounded down to whole elements; a slot is further rounded down to a multiple of 16 bytes, as
nccl-tests does (3 ranks of float32 asked for 1K move 3 × 336 B = 1008 B), so that the same ``-b/-e``
give the same rows in both tools. A size too small for one 16-byte slot per rank is a count-0 row.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshwise.comm.api import Collective
from meshwise.comm.bus_factor import SLOTTED, bus_factor

#: what ``meshwise bench`` measures: every collective, then the point-to-point ring
COLLECTIVES = (*(c.value for c in Collective), "sendrecv")
#: Collectives that apply a reduce op (the others print ``none`` in the redop column).
REDUCING = frozenset({"all_reduce", "reduce_scatter", "reduce"})
#: Collectives with a root (the others print ``-1`` in the root column, as nccl-tests).
ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter"})

#: 1 GB/s as nccl-tests prints it: 10^9 bytes per second, not 2^30.
GB = 1.0e9
#: Slots of the slotted collectives are whole multiples of this many bytes (nccl-tests' alignment).
SLOT_ALIGN_BYTES = 16


@dataclass(frozen=True)
class Layout:
    """Element counts of one benchmark row on every rank."""

    collective: str
    world_size: int
    itemsize: int
    count: int  # elements of the operation's parameter (nccl-tests' "count" column)
    #: all_to_all only: rank 0 is a hot spot that exchanges ``skew`` slots with every other rank
    skew: int = 1

    def split(self, src: int, dst: int) -> int:
        """Elements rank ``src`` sends rank ``dst`` in all_to_all: ``count``, or ``skew·count`` between
        rank 0 and another rank, both ways (a hot expert: it receives skew times the tokens of any
        other and sends as many results back). The matrix is symmetric, so every rank sends what it
        receives and the in-place form keeps its meaning."""
        return self.count * self.skew if (src == 0) != (dst == 0) else self.count

    def rank_elements(self, rank: int) -> int:
        """Elements of ``rank``'s per-rank buffer."""
        if self.skew == 1 or self.collective != "all_to_all":
            return self.total_elements
        return sum(self.split(rank, j) for j in range(self.world_size))

    @property
    def total_elements(self) -> int:
        """Elements of the larger per-rank buffer: n slots for slotted collectives, else ``count``; a
        skewed all_to_all's hot rank holds ``(skew·(n−1) + 1)`` slots."""
        if self.collective not in SLOTTED:
            return self.count
        return self.count * (self.skew * (self.world_size - 1) + 1)

    @property
    def nbytes(self) -> int:
        """S: the size column and the numerator of algbw."""
        return self.total_elements * self.itemsize


def layout_for(collective: str, size_bytes: int, world_size: int, itemsize: int, skew: int = 1) -> Layout:
    """The layout of a requested size: whole elements, and for slotted collectives slots of whole
    16-byte blocks (nccl-tests' ``(count / nranks) & -(16 / eltSize)``); count 0 when none fits. With
    ``skew`` (all_to_all only) the size is the hot rank's buffer of ``skew·(n−1) + 1`` slots."""
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}")
    if skew != 1 and (collective != "all_to_all" or skew < 1):
        raise ValueError(f"skew {skew} applies to all_to_all only, as a whole number >= 1")
    bus_factor(collective, world_size)  # validates the world size
    elements = size_bytes // itemsize
    if collective not in SLOTTED:
        return Layout(collective, world_size, itemsize, elements)
    block = max(1, SLOT_ALIGN_BYTES // itemsize)
    count = (elements // (skew * (world_size - 1) + 1)) // block * block
    return Layout(collective, world_size, itemsize, count, skew)


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (S / t)."""
    return nbytes / seconds / GB if seconds > 0 else 0.0


def busbw(collective: str, nbytes: int, seconds: float, world_size: int) -> float:
    """Bus bandwidth in GB/s (algbw · factor)."""
    return algbw(nbytes, seconds) * bus_factor(collective, world_size)
