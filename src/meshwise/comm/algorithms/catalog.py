"""Which plan implements which (collective, algorithm): the one place that maps names to plan builders."""

from __future__ import annotations

import functools

from meshwise.comm.algorithms import direct, doubling, ring, tree
from meshwise.comm.algorithms.plan import Plan


@functools.lru_cache(maxsize=512)
def build_plan(
    collective: str,
    algo: str,
    rank: int,
    world_size: int,
    sizes: tuple[int, ...],
    root: int = 0,
    pieces: int = 1,
) -> Plan:
    """The plan of ``algo`` for ``collective``: ``sizes`` is (count,) for whole-vector collectives, the
    per-slot counts for all_gather/reduce_scatter/scatter/gather (tree: in root-relative order), and
    send counts followed by receive counts for all_to_all."""
    counts = list(sizes)
    key = (collective, algo)
    if key == ("all_reduce", "ring"):
        return ring.all_reduce(rank, world_size, counts[0], pieces)
    if key == ("all_reduce", "rd"):
        return doubling.rd_all_reduce(rank, world_size, counts[0])
    if key == ("all_reduce", "rhd"):
        return doubling.rhd_all_reduce(rank, world_size, counts[0])
    if key == ("all_reduce", "tree"):
        return tree.all_reduce(rank, world_size, counts[0])
    if key == ("all_reduce", "linear"):
        return direct.all_reduce(rank, world_size, counts[0])
    if key == ("reduce_scatter", "ring"):
        return ring.reduce_scatter(rank, world_size, counts, pieces)
    if key == ("reduce_scatter", "rhd"):
        return doubling.rhd_reduce_scatter(rank, world_size, counts)
    if key == ("reduce_scatter", "linear"):
        return direct.reduce_scatter(rank, world_size, counts)
    if key == ("all_gather", "ring"):
        return ring.all_gather(rank, world_size, counts, pieces)
    if key == ("all_gather", "rd"):
        return doubling.rd_all_gather(rank, world_size, counts)
    if key == ("all_gather", "linear"):
        return direct.all_gather(rank, world_size, counts)
    if key == ("broadcast", "tree"):
        return tree.broadcast(rank, world_size, root, counts[0])
    if key == ("broadcast", "linear"):
        return direct.broadcast(rank, world_size, root, counts[0])
    if key == ("reduce", "tree"):
        return tree.reduce(rank, world_size, root, counts[0])
    if key == ("reduce", "linear"):
        return direct.reduce(rank, world_size, root, counts[0])
    if key == ("scatter", "tree"):
        return tree.scatter(rank, world_size, root, counts)
    if key == ("scatter", "linear"):
        return direct.scatter(rank, world_size, root, counts)
    if key == ("gather", "tree"):
        return tree.gather(rank, world_size, root, counts)
    if key == ("gather", "linear"):
        return direct.gather(rank, world_size, root, counts)
    if key == ("all_to_all", "pairwise") or key == ("all_to_all", "linear"):
        half = len(counts) // 2
        return direct.all_to_all(rank, world_size, counts[:half], counts[half:], pairwise=algo == "pairwise")
    raise ValueError(f"algorithm {algo!r} does not implement {collective}")
