"""The one registry: algorithm → collectives it implements → plan builder → cost formula.

Everything that asks "does ring do all_gather?", "what plan runs it?" or "what does it cost?" reads
:data:`REGISTRY`: the algorithm communicator, ``auto``'s choice, the calibration fit, the benchmark and the
tests. Adding an algorithm is one entry here (plus its plan module and formulas).

``native`` is the backend's own collective: it implements everything, runs no plan of ours, and is
priced with the formula of the algorithm it behaves like (gloo and NCCL use rings for the bulk
collectives). ``hierarchical`` composes per-node communicators instead of running one plan, and spans two
links, so it has no single-link formula (:func:`predict_seconds` prices it from both).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from meshwise.comm.algorithms import direct, doubling, ring, tree
from meshwise.comm.algorithms.plan import Plan
from meshwise.comm.collective import Collective
from meshwise.comm.cost import formulas as f
from meshwise.comm.cost.formulas import Coefficients, LinkParams

C = Collective


@dataclass(frozen=True)
class PlanRequest:
    """What a plan builder gets: ``counts`` is (count,) for whole-vector collectives, the per-slot counts
    for all_gather/reduce_scatter/scatter/gather (tree: in root-relative order), and send counts followed
    by receive counts for all_to_all."""

    rank: int
    world_size: int
    counts: tuple[int, ...]
    root: int
    pieces: int

    @property
    def count(self) -> int:
        return self.counts[0]

    @property
    def slots(self) -> list[int]:
        return list(self.counts)


@dataclass(frozen=True)
class Implementation:
    """How one algorithm runs one collective: its plan (None: not ours to plan) and its formula (None:
    no single-link formula)."""

    build: Callable[[PlanRequest], Plan] | None
    cost: Callable[[float, int], Coefficients] | None


@dataclass(frozen=True)
class Algorithm:
    """A named algorithm, what it implements, and its step count for the reference table."""

    name: str
    description: str
    steps: str
    implements: Mapping[Collective, Implementation]


Build = Callable[[PlanRequest], Plan]


# Adapters from the plan modules' signatures to a PlanRequest: a whole vector or per-slot counts, with
# or without a root, with or without ring pipelining.
def _vector(fn: Callable[[int, int, int], Plan]) -> Build:
    return lambda q: fn(q.rank, q.world_size, q.count)


def _slots(fn: Callable[[int, int, list[int]], Plan]) -> Build:
    return lambda q: fn(q.rank, q.world_size, q.slots)


def _rooted(fn: Callable[[int, int, int, int], Plan]) -> Build:
    return lambda q: fn(q.rank, q.world_size, q.root, q.count)


def _rooted_slots(fn: Callable[[int, int, int, list[int]], Plan]) -> Build:
    return lambda q: fn(q.rank, q.world_size, q.root, q.slots)


def _all_to_all(pairwise: bool) -> Build:
    def build(q: PlanRequest) -> Plan:
        half = len(q.counts) // 2
        sends, recvs = list(q.counts[:half]), list(q.counts[half:])
        return direct.all_to_all(q.rank, q.world_size, sends, recvs, pairwise=pairwise)

    return build


Impl = Implementation
_RING = {
    C.ALL_REDUCE: Impl(lambda q: ring.all_reduce(q.rank, q.world_size, q.count, q.pieces), f.ring_all_reduce),
    C.REDUCE_SCATTER: Impl(
        lambda q: ring.reduce_scatter(q.rank, q.world_size, q.slots, q.pieces), f.ring_reduce_scatter
    ),
    C.ALL_GATHER: Impl(lambda q: ring.all_gather(q.rank, q.world_size, q.slots, q.pieces), f.ring_all_gather),
}
_TREE = {
    C.ALL_REDUCE: Impl(_vector(tree.all_reduce), f.tree_all_reduce),
    C.BROADCAST: Impl(_rooted(tree.broadcast), f.tree_broadcast),
    C.REDUCE: Impl(_rooted(tree.reduce), f.tree_reduce),
    C.SCATTER: Impl(_rooted_slots(tree.scatter), f.tree_scatter_or_gather),
    C.GATHER: Impl(_rooted_slots(tree.gather), f.tree_scatter_or_gather),
}
_RD = {
    C.ALL_REDUCE: Impl(_vector(doubling.rd_all_reduce), f.rd_all_reduce),
    C.ALL_GATHER: Impl(_slots(doubling.rd_all_gather), f.rd_all_gather),
}
_RHD = {
    C.ALL_REDUCE: Impl(_vector(doubling.rhd_all_reduce), f.rhd_all_reduce),
    C.REDUCE_SCATTER: Impl(_slots(doubling.rhd_reduce_scatter), f.rhd_reduce_scatter),
}
_PAIRWISE = {C.ALL_TO_ALL: Impl(_all_to_all(pairwise=True), f.pairwise_all_to_all)}
_LINEAR = {
    C.ALL_REDUCE: Impl(_vector(direct.all_reduce), f.linear_all_reduce),
    C.REDUCE_SCATTER: Impl(_slots(direct.reduce_scatter), f.linear_reduce_scatter),
    C.ALL_GATHER: Impl(_slots(direct.all_gather), f.linear_slotted_exchange),
    C.BROADCAST: Impl(_rooted(direct.broadcast), f.linear_broadcast),
    C.REDUCE: Impl(_rooted(direct.reduce), f.linear_reduce),
    C.SCATTER: Impl(_rooted_slots(direct.scatter), f.linear_scatter_or_gather),
    C.GATHER: Impl(_rooted_slots(direct.gather), f.linear_scatter_or_gather),
    C.ALL_TO_ALL: Impl(_all_to_all(pairwise=False), f.linear_slotted_exchange),
}

#: the backend's own collectives behave like these (gloo and NCCL: rings for the bulk ones); no plan
_NATIVE = {
    C.ALL_REDUCE: Impl(None, f.ring_all_reduce),
    C.REDUCE_SCATTER: Impl(None, f.ring_reduce_scatter),
    C.ALL_GATHER: Impl(None, f.ring_all_gather),
    C.BROADCAST: Impl(None, f.tree_broadcast),
    C.REDUCE: Impl(None, f.tree_reduce),
    C.SCATTER: Impl(None, f.linear_scatter_or_gather),
    C.GATHER: Impl(None, f.linear_scatter_or_gather),
    C.ALL_TO_ALL: Impl(None, f.pairwise_all_to_all),
}

_ENTRIES = (
    Algorithm("native", "the base communicator's own collectives, priced by their shape", "-", _NATIVE),
    Algorithm("ring", "all_reduce = pipelined reduce-scatter + all-gather", "2(p-1), p-1, p-1", _RING),
    Algorithm("tree", "binomial trees; all_reduce = reduce + broadcast", "ceil(lg p) (x2 all_reduce)", _TREE),
    Algorithm("rd", "recursive doubling", "lg p (+2 folding)", _RD),
    Algorithm("rhd", "Rabenseifner: recursive halving, then doubling", "2 lg p, lg p (+2 folding)", _RHD),
    Algorithm("pairwise", "p-1 rounds of pairwise exchange", "p-1", _PAIRWISE),
    Algorithm("linear", "every message posted at once", "1 round, p-1 messages", _LINEAR),
    Algorithm(
        "hierarchical",
        "across nodes on 1/L of the data, then inside each node (all_reduce: RS, AR, AG)",
        "see formulas",
        # composed of per-node communicators; priced over two links
        {c: Impl(None, None) for c in (C.ALL_REDUCE, C.ALL_GATHER, C.BROADCAST)},
    ),
)

#: every algorithm by name
REGISTRY: dict[str, Algorithm] = {a.name: a for a in _ENTRIES}

#: what ``algo=`` accepts: the registry, plus ``auto`` (per call, the cheapest by the cost model)
ALGORITHMS: tuple[str, ...] = (*REGISTRY, "auto")

#: the spellings of the literature, accepted wherever a user names an algorithm
ALIASES = {"recursive-doubling": "rd", "rabenseifner": "rhd"}


def canonical_algorithm(name: str) -> str:
    """``name`` (or an alias such as ``rabenseifner``) as its registry name; ValueError listing the
    choices otherwise."""
    algo = ALIASES.get(name, name)
    if algo not in ALGORITHMS:
        aliases = ", ".join(f"{a} (= {b})" for a, b in ALIASES.items())
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}, or {aliases}")
    return algo


def covers(algo: str, collective: str) -> bool:
    """Whether ``algo`` implements ``collective`` (the others fall back to the backend's own)."""
    entry = REGISTRY.get(algo)
    return entry is not None and collective in entry.implements


def implemented(algo: str) -> tuple[Collective, ...]:
    """The collectives ``algo`` implements, in :class:`Collective` order."""
    return tuple(c for c in Collective if covers(algo, c))


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
    """The plan of ``algo`` for ``collective`` (``sizes`` as :class:`PlanRequest` ``counts``)."""
    impl = REGISTRY[algo].implements.get(collective) if algo in REGISTRY else None
    if impl is None or impl.build is None:
        raise ValueError(f"algorithm {algo!r} does not implement {collective}")
    return impl.build(PlanRequest(rank, world_size, sizes, root, pieces))


def coefficients(collective: str, algo: str, nbytes: float, world_size: int) -> Coefficients:
    """(a, b, c, s, d) with time = a·α + b·β + c·γ + s·σ + d·δ for a single-link algorithm
    (see :mod:`meshwise.comm.cost.formulas`); ``native`` is priced like the algorithm it behaves like."""
    Collective.parse(collective)
    impl = REGISTRY[algo].implements.get(collective) if algo in REGISTRY else None
    if impl is None or impl.cost is None:
        raise ValueError(f"no single-link cost for {collective} with algo {algo!r}")
    if world_size == 1:
        return (0.0, 0.0, 0.0, 0.0, 0.0)
    return impl.cost(float(nbytes), world_size)


def predict_seconds(
    collective: str,
    algo: str,
    nbytes: float,
    world_size: int,
    link: LinkParams,
    *,
    inter: LinkParams | None = None,
    local_size: int | None = None,
    switch: float = 0.0,
) -> float:
    """Predicted time of one call. ``hierarchical`` also needs ``inter`` and ``local_size`` (ranks per
    node), and may have ``switch``; ``link`` is then the intra-node one
    (:func:`~meshwise.comm.cost.formulas.hierarchical_seconds`)."""
    if algo == "hierarchical":
        if inter is None or local_size is None:
            raise ValueError("hierarchical cost needs inter= and local_size=")
        return f.hierarchical_seconds(collective, nbytes, world_size, local_size, link, inter, switch)
    return link.seconds(coefficients(collective, algo, nbytes, world_size))


def reference_table() -> str:
    """The registry as a text table (algorithm, collectives, steps): what ``meshwise bench --help`` and
    the docs show, generated so it cannot drift from the code."""
    rows = [("algo", "collectives", "steps (p ranks)", "how")]
    for a in REGISTRY.values():
        names = "every collective" if len(a.implements) == len(Collective) else ", ".join(implemented(a.name))
        rows.append((a.name, names, a.steps, a.description))
    rows.append(("auto", "per call, the cheapest by the cost model (native too)", "-", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r[:3], widths, strict=True)) + "  " + r[3] for r in rows
    ).rstrip()
