"""Ring algorithms: reduce-scatter, all-gather, and all-reduce as the two back to back.

Rank r sends to r+1 and receives from r−1. Reduce-scatter takes p−1 steps, each moving one block of
M/p, after which rank r owns the fully reduced block r; all-gather circulates the finished blocks in
p−1 more steps. All-reduce is therefore 2(p−1) steps and 2(p−1)/p·M bytes sent per rank — the
bandwidth-optimal schedule (Patarasuk & Yuan 2009; the seeds' ring all-reduce). Each block is cut into
``pieces`` segments and the executor forwards a segment as soon as it has been reduced, so on large
messages sends, receives and reductions of consecutive segments overlap (a pipelined ring).
"""

from __future__ import annotations

from meshwise.comm.algorithms.plan import Plan, PlanBuilder, Region, even_bounds, prefix, segments


def _block(bounds: list[int], index: int, buf: str = "data") -> Region:
    return Region(buf, bounds[index], bounds[index + 1])


def add_reduce_scatter(b: PlanBuilder, bounds: list[int], pieces: int, first_step: int = 0) -> None:
    """Ring reduce-scatter over blocks ``bounds`` of ``data``; rank r ends owning reduced block r.

    Step k sends block (r−k−1) and receives block (r−k−2), reducing it into ``data``; incoming pieces land
    in one of two scratch halves (by step parity) so the next step's receive never waits for a reduction.
    """
    r, p = b.rank, b.world_size
    if p == 1:
        return
    right, left = (r + 1) % p, (r - 1) % p
    widest = max(bounds[i + 1] - bounds[i] for i in range(p))
    b.need("tmp", 2 * widest)

    def incoming(step: int) -> tuple[list[Region], list[Region]]:
        block = _block(bounds, (r - step - 2) % p)
        base = (step % 2) * widest
        scratch = Region("tmp", base, base + len(block))
        return segments(scratch, pieces), segments(block, pieces)

    last = p - 2
    for seg in incoming(0)[0]:
        b.recv(left, seg, first_step)
    for seg in segments(_block(bounds, (r - 1) % p), pieces):
        b.send(right, seg, first_step)
    for step in range(p - 1):
        scratch_segs, block_segs = incoming(step)
        next_scratch = incoming(step + 1)[0] if step < last else []
        for s, (into, piece) in enumerate(zip(block_segs, scratch_segs, strict=True)):
            if s < len(next_scratch):
                b.recv(left, next_scratch[s], first_step + step + 1)
            b.reduce(into, piece)
            if step < last:
                b.send(right, into, first_step + step + 1)
        for extra in next_scratch[len(block_segs) :]:
            b.recv(left, extra, first_step + step + 1)


def add_all_gather(b: PlanBuilder, bounds: list[int], pieces: int, first_step: int = 0) -> None:
    """Ring all-gather: rank r starts with block r; step k forwards block (r−k) and receives (r−k−1)."""
    r, p = b.rank, b.world_size
    if p == 1:
        return
    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):  # every receive lands in a distinct block: post them all up front
        for seg in segments(_block(bounds, (r - step - 1) % p), pieces):
            b.recv(left, seg, first_step + step)
    for step in range(p - 1):
        for seg in segments(_block(bounds, (r - step) % p), pieces):
            b.send(right, seg, first_step + step)


def all_reduce(rank: int, world_size: int, count: int, pieces: int = 1) -> Plan:
    b = PlanBuilder("all_reduce", "ring", rank, world_size)
    bounds = even_bounds(count, world_size)
    add_reduce_scatter(b, bounds, pieces)
    add_all_gather(b, bounds, pieces, first_step=world_size - 1)
    return b.build()


def reduce_scatter(rank: int, world_size: int, counts: list[int], pieces: int = 1) -> Plan:
    b = PlanBuilder("reduce_scatter", "ring", rank, world_size)
    add_reduce_scatter(b, prefix(counts), pieces)
    return b.build()


def all_gather(rank: int, world_size: int, counts: list[int], pieces: int = 1) -> Plan:
    b = PlanBuilder("all_gather", "ring", rank, world_size)
    add_all_gather(b, prefix(counts), pieces)
    return b.build()
