"""Speedup, efficiency, rating and likely causes of a scaling study — pure arithmetic, no processes.

Strong scaling (fixed total work): S(n) = T(1)/T(n), E(n) = S(n)/n (the seeds' definitions). Weak scaling
(work grows with n): E(n) = T(1)/T(n), the scaled efficiency; the scaled speedup is n·E(n). When the
smallest measured scale n0 is not 1, n0 ranks are taken as perfectly efficient: S(n) = n0·T(n0)/T(n).

The Karp–Flatt metric e(n) = (1/S − 1/n)/(1 − 1/n) is the serial fraction Amdahl's law would need to
explain the measured speedup; a constant e over n means a fixed serial part, a growing e means overhead
that grows with n (communication, synchronisation).

Ratings use the seeds' bands: > 95 % excellent, 80–95 % good, 60–80 % acceptable, < 60 % poor. A point
below 95 % gets causes where the measurements show one: communication-bound when combining/communicating
takes more than 30 % of the wall time (the seeds' "NCCL > 30 % of step time"), load imbalance when the
slowest rank computes more than 10 % longer than the mean, oversubscription when there are more ranks
than cores.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

BANDS = ((0.95, "excellent"), (0.80, "good"), (0.60, "acceptable"), (0.0, "poor"))
#: A baseline that keeps more cores than this busy on average is itself parallel (threads).
MULTI_THREADED_CORES = 1.5
COMM_BOUND_FRACTION = 0.30
IMBALANCE_LIMIT = 0.10
MODES = ("strong", "weak")


@dataclass(frozen=True)
class Sample:
    """One run at one scale: its wall time and, where known, communication time and per-rank times."""

    wall_seconds: float
    comm_seconds: float | None = None
    rank_seconds: tuple[float, ...] = ()


@dataclass(frozen=True)
class ScalePoint:
    """The study's verdict for one rank count (times are medians over the repeats)."""

    ranks: int
    times: tuple[float, ...]
    wall_seconds: float
    speedup: float
    efficiency: float
    serial_fraction: float | None
    rating: str
    comm_fraction: float | None
    imbalance: float | None
    causes: tuple[str, ...]


def classify(efficiency: float) -> str:
    """The seeds' band for an efficiency given as a fraction: above 0.95 excellent, then down to (and
    including) 0.80 good, down to 0.60 acceptable, below that poor (0.9906 → "excellent")."""
    if efficiency > BANDS[0][0]:
        return BANDS[0][1]
    for floor, name in BANDS[1:]:
        if efficiency >= floor:
            return name
    return BANDS[-1][1]


def speedup_efficiency(mode: str, base_ranks: int, base_seconds: float, ranks: int, seconds: float):
    """``(speedup, efficiency)`` of ``ranks`` against the baseline; weak speedup is the scaled one."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if base_seconds <= 0 or seconds <= 0:
        raise ValueError(
            f"wall times must be positive, got T({base_ranks})={base_seconds}, T({ranks})={seconds}"
        )
    if mode == "strong":
        speedup = base_ranks * base_seconds / seconds
        return speedup, speedup / ranks
    efficiency = base_seconds / seconds
    return ranks * efficiency, efficiency


def karp_flatt(speedup: float, ranks: int) -> float | None:
    """Experimentally determined serial fraction; undefined for one rank."""
    if ranks <= 1:
        return None
    return (1.0 / speedup - 1.0 / ranks) / (1.0 - 1.0 / ranks)


def _imbalance(rank_seconds: Sequence[float]) -> float | None:
    if len(rank_seconds) < 2:
        return None
    mean = statistics.fmean(rank_seconds)
    return max(rank_seconds) / mean - 1.0 if mean > 0 else None


def _median_of(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _causes(
    point_ranks: int,
    efficiency: float,
    comm: float | None,
    imbalance: float | None,
    serial: float | None,
    cores: int | None,
    baseline_cores: float | None,
) -> tuple[str, ...]:
    if efficiency > BANDS[0][0]:
        return ()
    causes = []
    if baseline_cores is not None and baseline_cores > MULTI_THREADED_CORES:
        causes.append(
            f"multi-threaded baseline: the 1-rank run kept {baseline_cores:.1f} cores busy, so speedup "
            "is measured against a parallel run (not a serial part of the program); pin it to one "
            "thread (OMP_NUM_THREADS=1) to compare rank for rank"
        )
    if cores is not None and point_ranks > cores:
        causes.append(f"oversubscribed: {point_ranks} ranks share {cores} cores")
    if comm is not None and comm > COMM_BOUND_FRACTION:
        causes.append(f"communication-bound: {comm:.0%} of the wall time is communication/waiting")
    if imbalance is not None and imbalance > IMBALANCE_LIMIT:
        causes.append(f"load imbalance: slowest rank {imbalance:.0%} above the mean")
    if not causes:
        if serial is not None and serial > 0:  # Karp–Flatt assumes a one-core baseline (checked above)
            causes.append(f"fixed overhead: serial fraction ≈ {serial:.1%} (Karp–Flatt)")
        else:
            causes.append(
                "per-rank cost grows with n while comm and imbalance stay small: shared memory "
                "bandwidth/caches, or other load on the machine"
            )
    return tuple(causes)


def analyse(
    mode: str,
    samples: Mapping[int, Sequence[Sample]],
    cores: int | None = None,
    baseline_cores: float | None = None,
) -> list[ScalePoint]:
    """Turn the runs of each rank count into scale points, baseline = the smallest rank count.

    ``baseline_cores`` is how many cores a 1-rank baseline kept busy, when measured: above
    ``MULTI_THREADED_CORES`` the loss of efficiency is put down to a parallel baseline, not to a serial
    fraction."""
    if not samples:
        raise ValueError("no measurements to analyse")
    for ranks, runs in samples.items():
        if ranks < 1 or not runs:
            raise ValueError(f"scale {ranks} has no runs or is not a positive rank count")
    order = sorted(samples)
    base = order[0]
    base_time = statistics.median(s.wall_seconds for s in samples[base])
    points = []
    for ranks in order:
        runs = samples[ranks]
        wall = statistics.median(s.wall_seconds for s in runs)
        speedup, efficiency = speedup_efficiency(mode, base, base_time, ranks, wall)
        serial = karp_flatt(speedup, ranks) if mode == "strong" else None
        comm = _median_of(
            [s.comm_seconds / s.wall_seconds if s.comm_seconds is not None else None for s in runs]
        )
        imbalance = _median_of([_imbalance(s.rank_seconds) for s in runs])
        points.append(
            ScalePoint(
                ranks=ranks,
                times=tuple(s.wall_seconds for s in runs),
                wall_seconds=wall,
                speedup=speedup,
                efficiency=efficiency,
                serial_fraction=serial,
                rating=classify(efficiency),
                comm_fraction=comm,
                imbalance=imbalance,
                causes=_causes(
                    ranks, efficiency, comm, imbalance, serial, cores, baseline_cores if base == 1 else None
                ),
            )
        )
    return points
