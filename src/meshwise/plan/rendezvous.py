"""What a group that meets between slices of compute loses at each meeting, on this host (``cpu``).

:mod:`meshwise.plan.gloo_calls` times each collective called back to back, every endpoint already
waiting in it. In a step the tensor-parallel group's calls (context parallelism's gathers, expert
parallelism's all-to-alls) come between slices of compute: a call starts only when the last rank
arrives, and on a host whose cores other jobs share the ranks' slices drift apart with the scheduling,
and a rank that arrived first has blocked and must be woken. A profiled ``train gpt --tp 2`` step here
(load ~1.4) spent 230 ms blocked in its 28 all-reduces, whose back-to-back cost is ~40 ms; two processes
running a 28 ms matmul then a one-value gloo all-reduce lost 6 ms per call beyond both alone, 0.8 ms with
a 4 ms matmul.

Priced as :class:`Rendezvous`: each meeting costs ``alpha`` (waking the ranks that wait) plus ``drift``
times the compute since the previous one (the group moves at its slowest rank's pace). Measured now as
the layout's ranks run: threads of this process (one per rank, with the rank's torch threads), groups
of ``group`` side by side, each thread running slices of a square matmul with a meeting of its group
(a barrier) after each; per slice, the group's wall time beyond the mean slice, at a short and a long
slice (medians of :data:`REPEATS`), gives the line.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

#: matmul sizes of the short and the long slice (about 2 and 20 ms on one core)
SLICES = (320, 640)
#: slices per measurement, and measurements per slice size (the median is kept: one busy spell of the
#: host's other jobs moved a single measurement 5×)
ROUNDS = 16
REPEATS = 3


@dataclass(frozen=True)
class Rendezvous:
    """Seconds a group loses meeting ``syncs`` times over ``compute`` seconds of each rank's compute."""

    alpha: float
    drift: float

    def seconds(self, syncs: float, compute: float) -> float:
        return syncs * self.alpha + self.drift * compute


def fit_rendezvous(points: dict[float, float]) -> Rendezvous:
    """The line through the shortest and the longest of ``points`` (slice seconds → seconds lost per
    meeting), neither part below zero (noise larger than a difference prices it as nothing)."""
    (s0, l0), (s1, l1) = min(points.items()), max(points.items())
    drift = max(0.0, (l1 - l0) / (s1 - s0))
    return Rendezvous(max(0.0, l0 - drift * s0), drift)


def lost_per_meeting(group: int, ranks: int, size: int, rounds: int = ROUNDS) -> tuple[float, float]:
    """(mean slice seconds, seconds each meeting adds to it): ``ranks`` threads in groups of ``group``,
    each running ``rounds`` matmuls of ``size``² with a barrier of its group before each; the slowest
    thread's wall time per slice beyond the mean slice."""
    import torch

    barriers = [threading.Barrier(group) for _ in range(ranks // group)]
    slices: list[float] = []
    walls: list[float] = []

    def rank(index: int) -> None:
        a = torch.randn(size, size)
        a @ a  # warm up
        barrier = barriers[index // group]
        barrier.wait()
        started = time.perf_counter()
        for _ in range(rounds):
            barrier.wait()
            begun = time.perf_counter()
            a @ a
            slices.append(time.perf_counter() - begun)
        barrier.wait()
        walls.append(time.perf_counter() - started)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    mean = statistics.mean(slices)
    return mean, max(0.0, max(walls) / rounds - mean)


def measure_rendezvous(ranks: int) -> dict[int, Rendezvous]:
    """A :class:`Rendezvous` for every group size dividing ``ranks`` (2 and up), measured now."""
    measured = {}
    for group in (g for g in range(2, ranks + 1) if ranks % g == 0):
        points = {}
        for size in SLICES:
            runs = sorted(lost_per_meeting(group, ranks, size) for _ in range(REPEATS))
            slices, lost = zip(*runs, strict=True)
            points[statistics.median(slices)] = statistics.median(lost)
        measured[group] = fit_rendezvous(points)
    return measured
