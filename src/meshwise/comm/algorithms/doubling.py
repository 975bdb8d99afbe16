"""Recursive doubling and recursive halving-doubling (Rabenseifner), for any world size.

On a power-of-two world, recursive doubling pairs rank v with v XOR 2^k at step k and exchanges the whole
vector: lg p steps, latency-optimal, but M bytes each step (lg p·α + lg p·M·(β+γ)). Rabenseifner's
algorithm instead halves the exchanged vector while distances shrink (a reduce-scatter by recursive
halving) and then doubles it back (an all-gather by recursive doubling): 2·lg p steps but only
2(p−1)/p·M bytes — the medium-size sweet spot (Thakur, Rabenseifner & Gropp 2005).

Other world sizes fold: with p' the largest power of two ≤ p and rem = p − p', each even rank
r < 2·rem hands its vector to r+1 first and takes the result back last, so p' "virtual" ranks run the
power-of-two algorithm (2 extra steps). Virtual rank v is real rank 2v+1 for v < rem, else v + rem.
The recursive-doubling all-gather folds the same way, handing over one slot instead of the vector.
"""

from __future__ import annotations

from meshwise.comm.algorithms.plan import (
    Plan,
    PlanBuilder,
    Region,
    even_bounds,
    largest_power_of_two,
    prefix,
)


class _Fold:
    """Maps real ranks to the power-of-two virtual world and emits the fold-in / fold-out steps."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.p2 = largest_power_of_two(world_size)
        self.rem = world_size - self.p2
        self.extra = rank < 2 * self.rem and rank % 2 == 0  # folded out: idle during the core steps
        self.offset = 1 if self.rem else 0  # the core starts after the fold-in step
        if self.extra:
            self.virtual = -1
        elif rank < 2 * self.rem:
            self.virtual = rank // 2
        else:
            self.virtual = rank - self.rem

    def real(self, virtual: int) -> int:
        return 2 * virtual + 1 if virtual < self.rem else virtual + self.rem

    def bounds(self, slots: list[int]) -> list[int]:
        """Offsets of the virtual blocks: virtual rank v covers the slots of the real ranks it stands for
        (two for v < rem, one otherwise), contiguous and in rank order, given the real slot offsets."""
        return [slots[2 * v] if v <= self.rem else slots[v + self.rem] for v in range(self.p2 + 1)]


def _fold_in(b: PlanBuilder, fold: _Fold, whole: Region) -> None:
    if not fold.rem or b.rank >= 2 * fold.rem:
        return
    if fold.extra:
        b.send(b.rank + 1, whole, 0)
    else:
        b.need("tmp", len(whole))
        incoming = Region("tmp", 0, len(whole))
        b.recv(b.rank - 1, incoming, 0)
        b.reduce(whole, incoming)


def _halving(b: PlanBuilder, fold: _Fold, bounds: list[int]) -> None:
    """Recursive-halving reduce-scatter among virtual ranks; virtual rank v ends with block v."""
    v, lo, hi = fold.virtual, 0, fold.p2
    distance, step = fold.p2 // 2, fold.offset
    half = fold.p2 // 2
    b.need("tmp", max(bounds[half] - bounds[0], bounds[fold.p2] - bounds[half]))  # the widest kept half
    while distance >= 1:
        partner = fold.real(v ^ distance)
        mid = lo + distance
        keep, give = ((mid, hi), (lo, mid)) if v & distance else ((lo, mid), (mid, hi))
        kept = Region("data", bounds[keep[0]], bounds[keep[1]])
        incoming = Region("tmp", 0, len(kept))
        b.recv(partner, incoming, step)
        b.send(partner, Region("data", bounds[give[0]], bounds[give[1]]), step)
        b.reduce(kept, incoming)
        lo, hi = keep
        distance //= 2
        step += 1


def _doubling_gather(b: PlanBuilder, fold: _Fold, bounds: list[int], first_step: int) -> None:
    """Recursive-doubling all-gather among virtual ranks, each starting with its own block."""
    v, distance, step = fold.virtual, 1, first_step
    while distance < fold.p2:
        partner = v ^ distance
        mine, theirs = (v // distance) * distance, (partner // distance) * distance
        b.recv(fold.real(partner), Region("data", bounds[theirs], bounds[theirs + distance]), step)
        b.send(fold.real(partner), Region("data", bounds[mine], bounds[mine + distance]), step)
        distance *= 2
        step += 1


def _fold_out(b: PlanBuilder, fold: _Fold, region_of_extra: Region, step: int) -> None:
    if not fold.rem or b.rank >= 2 * fold.rem:
        return
    if fold.extra:
        b.recv(b.rank + 1, region_of_extra, step)
    else:
        b.send(b.rank - 1, region_of_extra, step)


def rd_all_reduce(rank: int, world_size: int, count: int) -> Plan:
    """Recursive doubling: exchange and reduce the whole vector with partner v XOR 2^k."""
    b = PlanBuilder("all_reduce", "rd", rank, world_size)
    fold = _Fold(rank, world_size)
    whole = Region("data", 0, count)
    _fold_in(b, fold, whole)
    lg = fold.p2.bit_length() - 1
    if not fold.extra:
        b.need("tmp", count)
        incoming = Region("tmp", 0, count)
        for k in range(lg):
            partner = fold.real(fold.virtual ^ (1 << k))
            b.recv(partner, incoming, fold.offset + k)
            b.send(partner, whole, fold.offset + k)
            b.reduce(whole, incoming)
    _fold_out(b, fold, whole, fold.offset + lg)
    return b.build()


def rhd_all_reduce(rank: int, world_size: int, count: int) -> Plan:
    """Rabenseifner: recursive-halving reduce-scatter, then recursive-doubling all-gather."""
    b = PlanBuilder("all_reduce", "rhd", rank, world_size)
    fold = _Fold(rank, world_size)
    whole = Region("data", 0, count)
    _fold_in(b, fold, whole)
    lg = fold.p2.bit_length() - 1
    if not fold.extra:
        bounds = even_bounds(count, fold.p2)
        _halving(b, fold, bounds)
        _doubling_gather(b, fold, bounds, fold.offset + lg)
    _fold_out(b, fold, whole, fold.offset + 2 * lg)
    return b.build()


def rhd_reduce_scatter(rank: int, world_size: int, counts: list[int]) -> Plan:
    """Recursive halving over virtual blocks; a virtual rank standing for two real ranks owns both slots
    and hands the folded-out rank its slot at the end."""
    b = PlanBuilder("reduce_scatter", "rhd", rank, world_size)
    fold = _Fold(rank, world_size)
    slots = prefix(counts)
    _fold_in(b, fold, Region("data", 0, slots[-1]))
    lg = fold.p2.bit_length() - 1
    if not fold.extra:
        _halving(b, fold, fold.bounds(slots))
    if fold.rem and rank < 2 * fold.rem:
        slot = rank if fold.extra else rank - 1  # the folded-out (even) rank's own slot
        _fold_out(b, fold, Region("data", slots[slot], slots[slot + 1]), fold.offset + lg)
    return b.build()


def rd_all_gather(rank: int, world_size: int, counts: list[int]) -> Plan:
    """Recursive-doubling all-gather (blocks may differ in size). Other world sizes fold: a folded-out
    rank hands its slot to its neighbour first and receives the whole gathered vector from it last."""
    b = PlanBuilder("all_gather", "rd", rank, world_size)
    fold = _Fold(rank, world_size)
    slots = prefix(counts)
    paired = fold.rem and rank < 2 * fold.rem
    if paired and fold.extra:
        b.send(rank + 1, Region("data", slots[rank], slots[rank + 1]), 0)
    elif paired:
        b.recv(rank - 1, Region("data", slots[rank - 1], slots[rank]), 0)
    if not fold.extra:
        _doubling_gather(b, fold, fold.bounds(slots), fold.offset)
    _fold_out(b, fold, Region("data", 0, slots[-1]), fold.offset + fold.p2.bit_length() - 1)
    return b.build()
