"""Plans: a collective algorithm as data — the ordered point-to-point and local steps one rank performs.

An algorithm is a pure function ``(rank, world_size, sizes) -> Plan``. Keeping it data (rather than code
that talks to a transport) lets tests check, without any process, that every send meets a receive of the
same size, that nothing deadlocks, that every element is reduced exactly once and that the number of
communication steps equals the cost model's; the executor then runs the same plan on any Communicator.

Buffers are named 1-D arrays: ``data`` (the working vector), ``tmp`` (scratch for incoming pieces),
``counts`` (int64 sizes exchanged ahead of uneven tree scatters/gathers) and ``in``/``out`` for
all-to-all. A :class:`Region` is a half-open element range of one buffer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Region:
    """Elements ``[start, stop)`` of buffer ``buf``."""

    buf: str
    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    def overlaps(self, other: Region) -> bool:
        return self.buf == other.buf and self.start < other.stop and other.start < self.stop


@dataclass(frozen=True, slots=True)
class Send:
    """Post a non-blocking send of ``src`` to ``peer`` (step: the algorithm's communication round)."""

    peer: int
    src: Region
    step: int


@dataclass(frozen=True, slots=True)
class Recv:
    """Post a non-blocking receive from ``peer`` into ``dst``."""

    peer: int
    dst: Region
    step: int


@dataclass(frozen=True, slots=True)
class Reduce:
    """``dst = op(dst, src)`` element-wise, once both regions hold their final data."""

    dst: Region
    src: Region


@dataclass(frozen=True, slots=True)
class Copy:
    """``dst = src``."""

    dst: Region
    src: Region


@dataclass(frozen=True, slots=True)
class Fence:
    """Wait for every posted send and receive (bounds the number of messages in flight)."""


Op = Send | Recv | Reduce | Copy | Fence


@dataclass(frozen=True)
class Plan:
    """The steps of one rank for one collective, and the scratch sizes it needs (elements per buffer)."""

    collective: str
    algo: str
    rank: int
    world_size: int
    ops: tuple[Op, ...]
    scratch: dict[str, int]

    @property
    def steps(self) -> int:
        """Communication rounds of the algorithm (the α multiplier of its cost), over all ranks' view."""
        rounds = {op.step for op in self.ops if isinstance(op, Send | Recv)}
        return max(rounds) + 1 if rounds else 0

    @property
    def exchange_steps(self) -> int:
        """Rounds in which this rank both sends and receives (the σ multiplier of its cost): such a
        round needs the rank and its peers running at once, which costs extra when ranks share cores."""
        sends = {op.step for op in self.ops if isinstance(op, Send)}
        recvs = {op.step for op in self.ops if isinstance(op, Recv)}
        return len(sends & recvs)


class PlanBuilder:
    """Accumulates ops; small helper so the algorithm modules read like their textbook description."""

    def __init__(self, collective: str, algo: str, rank: int, world_size: int) -> None:
        self.collective, self.algo, self.rank, self.world_size = collective, algo, rank, world_size
        self.ops: list[Op] = []
        self.scratch: dict[str, int] = {}

    def need(self, buf: str, elements: int) -> None:
        self.scratch[buf] = max(self.scratch.get(buf, 0), elements)

    def send(self, peer: int, src: Region, step: int) -> None:
        if len(src) and peer != self.rank:
            self.ops.append(Send(peer, src, step))

    def recv(self, peer: int, dst: Region, step: int) -> None:
        if len(dst) and peer != self.rank:
            self.ops.append(Recv(peer, dst, step))

    def reduce(self, dst: Region, src: Region) -> None:
        if len(dst):
            self.ops.append(Reduce(dst, src))

    def copy(self, dst: Region, src: Region) -> None:
        if len(dst) and dst != src:
            self.ops.append(Copy(dst, src))

    def fence(self) -> None:
        self.ops.append(Fence())

    def build(self) -> Plan:
        return Plan(self.collective, self.algo, self.rank, self.world_size, tuple(self.ops), self.scratch)


def even_bounds(total: int, parts: int) -> list[int]:
    """Offsets cutting ``total`` elements into ``parts`` nearly equal blocks (first blocks never smaller)."""
    return [-(-total * i // parts) for i in range(parts + 1)]


def prefix(counts: list[int]) -> list[int]:
    """Offsets of consecutive blocks with the given sizes."""
    out = [0]
    for count in counts:
        out.append(out[-1] + count)
    return out


def segments(region: Region, pieces: int) -> list[Region]:
    """``region`` cut into ``pieces`` contiguous sub-regions (the pipelining unit); empty ones dropped
    except when the region itself is empty."""
    cuts = [region.start + b for b in even_bounds(len(region), pieces)]
    parts = [Region(region.buf, a, b) for a, b in itertools.pairwise(cuts) if b > a]
    return parts or [region]


def largest_power_of_two(n: int) -> int:
    return 1 << (n.bit_length() - 1)
