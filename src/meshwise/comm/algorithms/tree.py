"""Binomial trees: broadcast, reduce, scatter and gather in ⌈lg p⌉ steps.

Ranks are renumbered relative to the root (v = (r − root) mod p). In a binomial tree, v's parent is
v minus its lowest set bit and its children are v + 2^k for every 2^k below that bit; the subtree of v is
the contiguous range [v, v + lowbit(v)). Broadcast sends the whole message down each edge
(⌈lg p⌉·(α + Mβ)); scatter and gather send each subtree's slots (⌈lg p⌉·α + (p−1)/p·Mβ). Slots are kept
in relative order, so a subtree's slots are one contiguous region.

Uneven scatter/gather: a non-root rank knows only its own slot size, so the sizes of its subtree travel
first, through the same tree, as an int64 ``counts`` vector (a scatter or gather of one element per rank);
``counts_plan_*`` build that exchange and the data plans take the sizes it delivered.
"""

from __future__ import annotations

from meshwise.comm.algorithms.plan import Plan, PlanBuilder, Region, prefix


def _lowbit(v: int, world_size: int) -> int:
    """Lowest set bit of v; the root (v = 0) stands above every level."""
    return v & -v if v else 1 << (world_size - 1).bit_length()


def _children(v: int, world_size: int) -> list[int]:
    """Children of v, nearest first (v+1, v+2, v+4, ...)."""
    out, mask = [], 1
    while mask < _lowbit(v, world_size) and v + mask < world_size:
        out.append(v + mask)
        mask <<= 1
    return out


def _subtree(v: int, world_size: int) -> tuple[int, int]:
    return v, min(v + _lowbit(v, world_size), world_size)


def _step(mask: int) -> int:
    """Round of an edge when the nearest child is served first (reduce, gather)."""
    return mask.bit_length() - 1


def _down_step(mask: int, world_size: int) -> int:
    """Round of an edge when the farthest child is served first (broadcast, scatter)."""
    return (world_size - 1).bit_length() - 1 - _step(mask)


def _region(buf: str, offsets: list[int], first: int, lo: int, hi: int) -> Region:
    """Slots [lo, hi) of a buffer that starts at slot ``first``."""
    return Region(buf, offsets[lo] - offsets[first], offsets[hi] - offsets[first])


def relative_order(world_size: int, root: int) -> list[int]:
    """Real rank of each relative position: slot i of a tree buffer belongs to rank (i + root) mod p."""
    return [(v + root) % world_size for v in range(world_size)]


def add_broadcast(b: PlanBuilder, root: int, count: int, first_step: int = 0) -> None:
    p = b.world_size
    v = (b.rank - root) % p
    whole = Region("data", 0, count)
    if v:
        b.recv((v - _lowbit(v, p) + root) % p, whole, first_step + _down_step(_lowbit(v, p), p))
    for child in reversed(_children(v, p)):  # farthest child first: it heads the largest subtree
        b.send((child + root) % p, whole, first_step + _down_step(child - v, p))


def add_reduce(b: PlanBuilder, root: int, count: int) -> None:
    """Children's partial results arrive (all receives posted at once), are reduced in child order, and
    the result goes to the parent."""
    p = b.world_size
    v = (b.rank - root) % p
    whole = Region("data", 0, count)
    children = _children(v, p)
    b.need("tmp", count * len(children))
    for i, child in enumerate(children):
        b.recv((child + root) % p, Region("tmp", i * count, (i + 1) * count), _step(child - v))
    for i in range(len(children)):
        b.reduce(whole, Region("tmp", i * count, (i + 1) * count))
    if v:
        b.send((v - _lowbit(v, p) + root) % p, whole, _step(_lowbit(v, p)))


def broadcast(rank: int, world_size: int, root: int, count: int) -> Plan:
    b = PlanBuilder("broadcast", "tree", rank, world_size)
    add_broadcast(b, root, count)
    return b.build()


def reduce(rank: int, world_size: int, root: int, count: int) -> Plan:
    b = PlanBuilder("reduce", "tree", rank, world_size)
    add_reduce(b, root, count)
    return b.build()


def all_reduce(rank: int, world_size: int, count: int) -> Plan:
    """Reduce to rank 0, then broadcast from it: 2⌈lg p⌉ steps of the whole message (latency-bound use)."""
    b = PlanBuilder("all_reduce", "tree", rank, world_size)
    add_reduce(b, 0, count)
    add_broadcast(b, 0, count, first_step=(world_size - 1).bit_length())
    return b.build()


def scatter(rank: int, world_size: int, root: int, counts: list[int], buf: str = "data") -> Plan:
    """``counts`` are slot sizes in relative order (only the entries of this rank's subtree are read);
    ``buf`` holds this rank's subtree slots from offset 0 (the root: all of them)."""
    p = world_size
    b = PlanBuilder("scatter", "tree", rank, p)
    v = (rank - root) % p
    first, _ = _subtree(v, p)
    offsets = prefix(counts)
    if v:
        region = _region(buf, offsets, first, *_subtree(v, p))
        b.recv((v - _lowbit(v, p) + root) % p, region, _down_step(_lowbit(v, p), p))
    for child in reversed(_children(v, p)):
        b.send(
            (child + root) % p, _region(buf, offsets, first, *_subtree(child, p)), _down_step(child - v, p)
        )
    return b.build()


def gather(rank: int, world_size: int, root: int, counts: list[int], buf: str = "data") -> Plan:
    """Mirror of :func:`scatter`: children's subtrees arrive into their regions, then this whole subtree
    goes to the parent."""
    p = world_size
    b = PlanBuilder("gather", "tree", rank, p)
    v = (rank - root) % p
    first, _ = _subtree(v, p)
    offsets = prefix(counts)
    for child in _children(v, p):
        b.recv((child + root) % p, _region(buf, offsets, first, *_subtree(child, p)), _step(child - v))
    if v:
        b.send(
            (v - _lowbit(v, p) + root) % p,
            _region(buf, offsets, first, *_subtree(v, p)),
            _step(_lowbit(v, p)),
        )
    return b.build()


def subtree_size(rank: int, world_size: int, root: int) -> int:
    """How many slots this rank's subtree holds (the length of its ``counts`` exchange)."""
    lo, hi = _subtree((rank - root) % world_size, world_size)
    return hi - lo


def counts_plan_scatter(rank: int, world_size: int, root: int) -> Plan:
    """Scatter of one int64 size per rank, so every rank learns its subtree's slot sizes."""
    return scatter(rank, world_size, root, [1] * world_size, buf="counts")


def counts_plan_gather(rank: int, world_size: int, root: int) -> Plan:
    return gather(rank, world_size, root, [1] * world_size, buf="counts")
