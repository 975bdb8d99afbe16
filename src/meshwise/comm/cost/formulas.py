"""The α-β-γ(-σ-δ) formulas: what one call of each algorithm costs, as coefficients of link parameters.

A message of n bytes over one link costs α + n·β (α: latency per message, β: seconds per byte) and
reducing n bytes costs n·γ. Each (collective, algorithm) pair is a linear form a·α + b·β + c·γ + s·σ + d·δ
whose coefficients depend only on n and the world size p — the classic formulas of Thakur, Rabenseifner &
Gropp (2005), e.g. ring all-reduce 2(p−1)α + 2(p−1)/p·nβ + (p−1)/p·nγ, recursive doubling
lg p·(α + nβ + nγ), Rabenseifner 2·lg p·α + 2(p−1)/p·nβ + (p−1)/p·nγ, binomial broadcast lg p·(α + nβ).
Sizes: n is the full vector for all_reduce/reduce/broadcast, all slots together for all_gather,
reduce_scatter, scatter and gather, and one rank's whole input for all_to_all (an uneven all_to_all is
priced at :func:`uneven_all_to_all_bytes`, its busiest rank's traffic).

σ and δ describe ranks that share cores. In an *exchange step* every rank both sends and receives (ring,
recursive doubling and halving, pairwise), so all ranks must run at once; with more ranks than cores each
such step waits for a scheduling round (σ per step) and both directions share the cores (δ per byte moved
in such steps). Tree steps are one-way and pay neither, which is why the binomial tree beats recursive
doubling on 4 ranks over 2 cores although it takes twice the steps. Where every rank has a core of its
own a fit leaves σ = δ = 0 and the classic model remains.

A link shaped by a token bucket (``tc … tbf``, a cloud instance's burst credit) charges β only on the
bytes past its credit: ``burst`` in :class:`LinkParams`, so a call costs … + β·max(0, b − burst). A
plain link has none, and then every price is the linear form above.

Each function here is one formula ``(nbytes, world_size) -> Coefficients`` for ``world_size >= 2``; which
algorithm runs which collective with which formula is the registry's business
(:mod:`meshwise.comm.algorithms.registry`). Everything is pure so the planner can price hypothetical
machines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

#: (a, b, c, s, d): messages on the busiest rank, bytes moved, bytes reduced, exchange steps, and bytes
#: moved in exchange steps — the multipliers of α, β, γ, σ, δ
Coefficients = tuple[float, float, float, float, float]


@dataclass(frozen=True)
class LinkParams:
    """α (s per message), β (s per byte moved), γ (s per byte reduced), the oversubscription terms σ (s
    per exchange step) and δ (s per byte moved in exchange steps), and ``burst``: the bytes of the β term
    each call moves before β applies (see the module docstring)."""

    alpha: float
    beta: float
    gamma: float
    sigma: float = 0.0
    delta: float = 0.0
    #: A token-bucket link (``tc … tbf``, a cloud instance's burst credit) passes a call's first bytes at
    #: the wire's speed and only the rest at its rate: the bucket refills while the link idles, and every
    #: call idles it for its latency-bound steps. In β-coefficient bytes (the busiest rank's bytes moved),
    #: fitted by :func:`~meshwise.comm.cost.fit.fit_link_params` (``burst=True``); 0 on a plain link.
    burst: float = 0.0

    def __post_init__(self) -> None:
        for name in (*PARAMETERS, "burst"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"LinkParams.{name} must be a finite non-negative number, got {value!r}")

    def seconds(self, terms: Coefficients) -> float:
        """The time ``terms`` stand for on this link."""
        a, b, c, s, d = terms
        return (
            a * self.alpha
            + max(0.0, b - self.burst) * self.beta
            + c * self.gamma
            + s * self.sigma
            + d * self.delta
        )


#: the fields of :class:`LinkParams`, in the order of :data:`Coefficients`
PARAMETERS = ("alpha", "beta", "gamma", "sigma", "delta")


def _lg(p: int) -> int:
    """⌈log₂ p⌉: the rounds of a binomial tree."""
    return (p - 1).bit_length()


def _doubling(p: int) -> tuple[int, int]:
    """(lg p2, fold) for recursive doubling/halving: p2 the largest power of two ≤ p, and fold 1 when
    the ranks beyond p2 must fold in before and out after (one one-way step each)."""
    p2 = 1 << (p.bit_length() - 1)
    return p2.bit_length() - 1, int(p != p2)


def _halving_bytes(n: float, p: int) -> float:
    """Bytes one rank moves while recursively halving n bytes among the largest power of two ≤ p."""
    p2 = 1 << (p.bit_length() - 1)
    return (p2 - 1) / p2 * n


def ring_all_reduce(n: float, p: int) -> Coefficients:
    frac = (p - 1) / p
    return (2 * (p - 1), 2 * frac * n, frac * n, 2 * (p - 1), 2 * frac * n)


def ring_reduce_scatter(n: float, p: int) -> Coefficients:
    frac = (p - 1) / p
    return (p - 1, frac * n, frac * n, p - 1, frac * n)


def ring_all_gather(n: float, p: int) -> Coefficients:
    frac = (p - 1) / p
    return (p - 1, frac * n, 0.0, p - 1, frac * n)


def rd_all_reduce(n: float, p: int) -> Coefficients:
    lg2, fold = _doubling(p)
    return (lg2 + 2 * fold, n * (lg2 + 2 * fold), n * (lg2 + fold), lg2, lg2 * n)


def rd_all_gather(n: float, p: int) -> Coefficients:
    lg2, fold = _doubling(p)
    frac = (p - 1) / p
    return (lg2 + 2 * fold, frac * n + fold * n, 0.0, lg2, frac * n)


def rhd_all_reduce(n: float, p: int) -> Coefficients:
    lg2, fold = _doubling(p)
    halving = _halving_bytes(n, p)
    return (2 * lg2 + 2 * fold, 2 * halving + 2 * fold * n, halving + fold * n, 2 * lg2, 2 * halving)


def rhd_reduce_scatter(n: float, p: int) -> Coefficients:
    lg2, fold = _doubling(p)
    halving = _halving_bytes(n, p)
    return (lg2 + 2 * fold, halving + fold * n * (1 + 1 / p), halving + fold * n, lg2, halving)


# Rooted steps (trees, linear broadcast/reduce/scatter/gather) are one-way: no σ, no δ.
def tree_all_reduce(n: float, p: int) -> Coefficients:
    lg = _lg(p)
    return (2 * lg, 2 * lg * n, lg * n, 0.0, 0.0)


def tree_broadcast(n: float, p: int) -> Coefficients:
    lg = _lg(p)
    return (lg, lg * n, 0.0, 0.0, 0.0)


def tree_reduce(n: float, p: int) -> Coefficients:
    lg = _lg(p)
    return (lg, lg * n, lg * n, 0.0, 0.0)


def tree_scatter_or_gather(n: float, p: int) -> Coefficients:
    """The slot sizes travel through the same tree first (uneven slots): twice the rounds."""
    return (2 * _lg(p), (p - 1) / p * n, 0.0, 0.0, 0.0)


def linear_all_reduce(n: float, p: int) -> Coefficients:
    return (p - 1, (p - 1) * n, (p - 1) * n, 1.0, (p - 1) * n)


def linear_slotted_exchange(n: float, p: int, reduces: bool = False) -> Coefficients:
    """Every rank sends its p−1 foreign slots at once (reduce_scatter, all_gather, all_to_all)."""
    frac = (p - 1) / p
    return (p - 1, frac * n, frac * n if reduces else 0.0, 1.0, frac * n)


def linear_reduce_scatter(n: float, p: int) -> Coefficients:
    return linear_slotted_exchange(n, p, reduces=True)


def linear_broadcast(n: float, p: int) -> Coefficients:
    return (p - 1, (p - 1) * n, 0.0, 0.0, 0.0)


def linear_reduce(n: float, p: int) -> Coefficients:
    return (p - 1, (p - 1) * n, (p - 1) * n, 0.0, 0.0)


def linear_scatter_or_gather(n: float, p: int) -> Coefficients:
    return (p - 1, (p - 1) / p * n, 0.0, 0.0, 0.0)


def pairwise_all_to_all(n: float, p: int) -> Coefficients:
    frac = (p - 1) / p
    return (p - 1, frac * n, 0.0, p - 1, frac * n)


def uneven_all_to_all_bytes(send_bytes: Sequence[Sequence[float]]) -> float:
    """The n at which the all_to_all formulas price an uneven exchange (``send_bytes[i][j]``: what rank i
    sends rank j). Every rank moves its own slots concurrently, so the call lasts as long as the busiest
    rank: the most foreign bytes any rank sends or receives. The even formulas charge (p−1)/p·n per rank,
    so the busiest rank's bytes times p/(p−1) is the even n that costs the same: a hot expert that
    receives k times the mean makes the exchange k times as slow as the balanced one of the same total."""
    p = len(send_bytes)
    if p < 2:
        return 0.0
    sent = [sum(row) - row[i] for i, row in enumerate(send_bytes)]
    received = [sum(send_bytes[i][j] for i in range(p)) - send_bytes[j][j] for j in range(p)]
    return max(*sent, *received) * p / (p - 1)


def hierarchical_seconds(
    collective: str,
    nbytes: float,
    world_size: int,
    local_size: int,
    intra: LinkParams,
    inter: LinkParams,
    switch: float = 0.0,
) -> float:
    """Two links, so no single coefficient vector. L = ``local_size`` ranks per node, N nodes:

    * all_reduce: ring reduce-scatter within each node, the faster of ring and Rabenseifner all-reduce of
      n/L bytes across nodes, ring all-gather within each node;
    * all_gather: ring all-gather of n/L bytes (N slots of n/p) across nodes, then of n within the node;
    * broadcast: binomial broadcast of n across nodes, then within each node. Only one rank per node
      crosses here, so pricing that step with ``inter`` (below) is conservative on a shared network.

    ``inter`` is the link one rank sees while its L node-mates cross at the same time (how
    ``meshwise bench --calibrate`` measures it): where the nodes' network is the bottleneck, its β is L
    times the link's own, and that sharing is what makes the two-level all-reduce (2 − 1/L)× a flat
    ring on two nodes rather than 2(p−1)/p ÷ 2(N−1)/(N·L).

    ``switch`` is the time one hand-over between the levels costs beyond the two levels' own calls
    (:attr:`~meshwise.comm.cost.calibration.Levels.switch`): all_reduce hands over twice (into the
    inter-node call and out of it), all_gather and broadcast once.
    """
    if local_size < 1 or world_size % local_size:
        raise ValueError(f"local_size {local_size} must divide the world size {world_size}")
    nodes = world_size // local_size
    within = across = 0.0
    if collective == "all_reduce":
        if local_size > 1:
            within = intra.seconds(ring_reduce_scatter(nbytes, local_size))
            within += intra.seconds(ring_all_gather(nbytes, local_size))
        if nodes > 1:
            shard = nbytes / local_size
            across = min(inter.seconds(f(shard, nodes)) for f in (ring_all_reduce, rhd_all_reduce))
    elif collective == "all_gather":
        within = intra.seconds(ring_all_gather(nbytes, local_size)) if local_size > 1 else 0.0
        across = inter.seconds(ring_all_gather(nbytes / local_size, nodes)) if nodes > 1 else 0.0
    elif collective == "broadcast":
        within = intra.seconds(tree_broadcast(nbytes, local_size)) if local_size > 1 else 0.0
        across = inter.seconds(tree_broadcast(nbytes, nodes)) if nodes > 1 else 0.0
    else:
        raise ValueError(
            f"hierarchical cost is defined for all_reduce, all_gather and broadcast, not {collective}"
        )
    handovers = (2 if collective == "all_reduce" else 1) if local_size > 1 and nodes > 1 else 0
    return within + across + handovers * switch
