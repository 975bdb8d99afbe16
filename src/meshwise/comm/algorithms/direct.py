"""Direct algorithms: every rank talks to its final peers at once (linear), or one peer per step (pairwise).

Linear versions post every message immediately: one round of latency but p−1 messages through the
busiest rank, which is the best schedule for tiny worlds and tiny messages. Pairwise exchange is the
all-to-all of choice for larger ones: at step k rank r sends to r+k and receives from r−k, and a fence
after each step keeps a single message in flight each way ((p−1)α + (p−1)/p·Mβ per rank), which avoids
flooding one receiver with everyone's data at once.
"""

from __future__ import annotations

from meshwise.comm.algorithms.plan import Plan, PlanBuilder, Region, prefix


def _slot(offsets: list[int], i: int, buf: str) -> Region:
    return Region(buf, offsets[i], offsets[i + 1])


def broadcast(rank: int, world_size: int, root: int, count: int) -> Plan:
    b = PlanBuilder("broadcast", "linear", rank, world_size)
    whole = Region("data", 0, count)
    if rank == root:
        for peer in range(world_size):
            b.send(peer, whole, 0)
    else:
        b.recv(root, whole, 0)
    return b.build()


def reduce(rank: int, world_size: int, root: int, count: int) -> Plan:
    """The root receives every vector at once and reduces them in rank order."""
    b = PlanBuilder("reduce", "linear", rank, world_size)
    whole = Region("data", 0, count)
    if rank != root:
        b.send(root, whole, 0)
        return b.build()
    b.need("tmp", count * world_size)
    pieces = [Region("tmp", i * count, (i + 1) * count) for i in range(world_size)]
    for peer in range(world_size):
        b.recv(peer, pieces[peer], 0)
    for peer in range(world_size):
        if peer != root:
            b.reduce(whole, pieces[peer])
    return b.build()


def all_reduce(rank: int, world_size: int, count: int) -> Plan:
    """Everyone sends its vector to everyone and reduces all of them in rank order, so every rank
    performs the same floating-point operations and ends bit-identical."""
    b = PlanBuilder("all_reduce", "linear", rank, world_size)
    whole = Region("data", 0, count)
    b.need("tmp", count * world_size)
    pieces = [Region("tmp", i * count, (i + 1) * count) for i in range(world_size)]
    for peer in range(world_size):
        b.recv(peer, pieces[peer], 0)
    for peer in range(world_size):
        b.send(peer, whole, 0)
    b.copy(pieces[rank], whole)
    b.copy(whole, pieces[0])
    for peer in range(1, world_size):
        b.reduce(whole, pieces[peer])
    return b.build()


def all_gather(rank: int, world_size: int, counts: list[int]) -> Plan:
    b = PlanBuilder("all_gather", "linear", rank, world_size)
    offsets = prefix(counts)
    for peer in range(world_size):
        b.recv(peer, _slot(offsets, peer, "data"), 0)
    for peer in range(world_size):
        b.send(peer, _slot(offsets, rank, "data"), 0)
    return b.build()


def reduce_scatter(rank: int, world_size: int, counts: list[int]) -> Plan:
    """Slot j goes straight to rank j, which reduces the p contributions in rank order."""
    b = PlanBuilder("reduce_scatter", "linear", rank, world_size)
    offsets = prefix(counts)
    own = counts[rank]
    b.need("tmp", own * world_size)
    pieces = [Region("tmp", i * own, (i + 1) * own) for i in range(world_size)]
    for peer in range(world_size):
        b.recv(peer, pieces[peer], 0)
    for peer in range(world_size):
        b.send(peer, _slot(offsets, peer, "data"), 0)
    mine = _slot(offsets, rank, "data")
    b.copy(pieces[rank], mine)
    b.copy(mine, pieces[0])
    for peer in range(1, world_size):
        b.reduce(mine, pieces[peer])
    return b.build()


def _rooted_slots(collective: str, rank: int, world_size: int, root: int, counts: list[int]) -> Plan:
    """Scatter (root sends slot i to rank i) or gather (rank i sends to root's slot i), all at once.
    Root's ``data`` holds the slots in rank order; a non-root's ``data`` is just its own slot."""
    b = PlanBuilder(collective, "linear", rank, world_size)
    to_root = collective == "gather"
    if rank == root:
        offsets = prefix(counts)
        for peer in range(world_size):
            (b.recv if to_root else b.send)(peer, _slot(offsets, peer, "data"), 0)
    else:
        (b.send if to_root else b.recv)(root, Region("data", 0, counts[rank]), 0)
    return b.build()


def scatter(rank: int, world_size: int, root: int, counts: list[int]) -> Plan:
    return _rooted_slots("scatter", rank, world_size, root, counts)


def gather(rank: int, world_size: int, root: int, counts: list[int]) -> Plan:
    return _rooted_slots("gather", rank, world_size, root, counts)


def all_to_all(
    rank: int, world_size: int, send_counts: list[int], recv_counts: list[int], *, pairwise: bool
) -> Plan:
    """``in`` holds the slots for each destination, ``out`` receives one slot from each source."""
    b = PlanBuilder("all_to_all", "pairwise" if pairwise else "linear", rank, world_size)
    ins, outs = prefix(send_counts), prefix(recv_counts)
    b.copy(_slot(outs, rank, "out"), _slot(ins, rank, "in"))
    for k in range(1, world_size):
        dst, src = (rank + k) % world_size, (rank - k) % world_size
        step = k - 1 if pairwise else 0
        b.recv(src, _slot(outs, src, "out"), step)
        b.send(dst, _slot(ins, dst, "in"), step)
        if pairwise:
            b.fence()
    return b.build()
