"""Run one workload at one rank count and measure it: π jobs in-process, anything else as a command.

A command reports its own wall time on a line ``Wall time = <seconds> s`` (the seeds' format; ``ms`` is
also accepted, as is a leading ``[rank N]`` from ``meshwise run``), so process start-up and imports are
not counted, exactly as the seeds record their tables. Optional lines refine the diagnosis:
``Comm time = <seconds> s`` (time spent communicating) and per-rank lines
``rank R/N | ... | time = <seconds> s`` (per-rank compute time, for load imbalance). A command
that prints no wall-time line is timed around the process instead, and the study says so.

``{np}`` in the command is replaced by the rank count and ``{work}`` by the work size (the same at every
scale for strong scaling, multiplied by the rank count for weak scaling).
"""

from __future__ import annotations

import re
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from meshwise.runtime.spawn import spawn
from meshwise.scale.metrics import Sample
from meshwise.workloads.pi_job import PiJob, pi_rank_main

PI_WORKLOADS = {"pi-midpoint": "midpoint", "pi-montecarlo": "montecarlo"}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_PREFIX = r"^(?:\[rank \d+\])?\s*"  # `meshwise run` prefixes worker lines with [rank N]
WALL_TIME_LINE = re.compile(rf"{_PREFIX}Wall time\s*=\s*{_NUMBER}\s*(s|ms)\s*$", re.MULTILINE)
COMM_TIME_LINE = re.compile(rf"{_PREFIX}Comm time\s*=\s*{_NUMBER}\s*(s|ms)\s*$", re.MULTILINE)
RANK_TIME_LINE = re.compile(
    rf"{_PREFIX}rank\s+(\d+)/(\d+)\b.*\|\s*time\s*=\s*{_NUMBER}\s*(s|ms)\s*$", re.MULTILINE
)


T = TypeVar("T")


def cores_busy(run: Callable[[], T]) -> tuple[T, float]:
    """``run()``'s result and how many cores its child processes kept busy on average (their CPU time
    over the wall time). A 1-rank baseline above one core is itself multi-threaded, which changes what
    the study's speedups mean."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = run()
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return result, cpu / elapsed if elapsed > 0 else 0.0


class ScaleError(RuntimeError):
    """A run of the study failed or reported nothing usable; the message says which and why."""


@dataclass(frozen=True)
class Workload:
    """What to run: a built-in π job (``method``) or a command template (``argv``)."""

    name: str
    method: str | None = None
    argv: tuple[str, ...] = ()

    @property
    def is_command(self) -> bool:
        return self.method is None


def parse_workload(tokens: Sequence[str]) -> Workload:
    """``pi-midpoint``, ``pi-montecarlo``, ``train:<model> [ARGS]`` or a command containing ``{np}``."""
    if not tokens:
        raise ValueError(
            "name a workload: pi-midpoint, pi-montecarlo, train:<model>, or -- CMD ARGS with {np}"
        )
    head, rest = tokens[0], tuple(tokens[1:])
    if head in PI_WORKLOADS:
        if rest:
            raise ValueError(f"{head} takes no extra arguments (got {' '.join(rest)}); use --work/--seed")
        return Workload(head, method=PI_WORKLOADS[head])
    if head.startswith("train:"):
        model = head.removeprefix("train:")
        if not model:
            raise ValueError("train:<model> needs a model name, e.g. train:mlp")
        argv = (sys.executable, "-m", "meshwise", "train", model, "-np", "{np}", *rest)
        return Workload(head, argv=argv)
    if shutil.which(head) is None:
        raise ValueError(
            f"{head!r} is neither a workload (pi-midpoint, pi-montecarlo, train:<model>) nor an executable "
            "on PATH; put a command after `--`"
        )
    if not any("{np}" in token for token in tokens):
        raise ValueError(
            "the command must contain {np} where the rank count goes (e.g. `-- meshwise pi montecarlo 1e9 "
            "-np {np}`), otherwise every scale would run the same job"
        )
    return Workload(" ".join(tokens), argv=tuple(tokens))


def _seconds(value: str, unit: str) -> float:
    return float(value) / (1000.0 if unit == "ms" else 1.0)


def parse_output(text: str) -> Sample | None:
    """The :class:`Sample` a command's output describes (last wall-time line wins), or None without one."""
    walls = WALL_TIME_LINE.findall(text)
    if not walls:
        return None
    comms = COMM_TIME_LINE.findall(text)
    per_rank = {int(rank): _seconds(v, u) for rank, _, v, u in RANK_TIME_LINE.findall(text)}
    return Sample(
        wall_seconds=_seconds(*walls[-1]),
        comm_seconds=_seconds(*comms[-1]) if comms else None,
        rank_seconds=tuple(per_rank[r] for r in sorted(per_rank)),
    )


def run_command(argv: Sequence[str], ranks: int, work: int | None, timeout: float) -> tuple[Sample, str]:
    """Run the command once at ``ranks``; returns the sample and where its wall time came from."""
    concrete = [token.replace("{np}", str(ranks)) for token in argv]
    if work is not None:
        concrete = [token.replace("{work}", str(work)) for token in concrete]
    start = time.perf_counter()
    try:
        done = subprocess.run(concrete, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise ScaleError(f"`{' '.join(concrete)}` ran past {timeout:g} s (killed)") from None
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-10:]
        raise ScaleError(f"`{' '.join(concrete)}` exited with {done.returncode}:\n" + "\n".join(tail))
    sample = parse_output(done.stdout)
    if sample is None:
        return Sample(wall_seconds=elapsed), "process"
    return sample, "reported"


def run_pi(
    method: str,
    ranks: int,
    work: int,
    *,
    repeat: int,
    seed: int,
    device: str | None,
    backend: str,
    timeout: float,
    kernel: str,
) -> list[Sample]:
    """``repeat`` runs of the π job on ``ranks`` spawned ranks (one start-up and warm-up for all repeats).

    ``kernel`` must be ``eager`` or ``fused`` — the same at every scale, so a study compares ranks, not
    kernels.

    On CPU every rank computes on one thread: ranks are the unit of parallelism being measured, as one
    MPI process per core would be.
    """
    threads = 1 if device != "cuda" else None
    job = PiJob(
        method, work, seed, backend, device, None, repeat, kernel, threads, warmup=True, timeout=timeout
    )
    reports = spawn(pi_rank_main, ranks, (job,), timeout=timeout)[0]
    return [
        Sample(
            wall_seconds=r.wall_seconds,
            comm_seconds=r.comm_seconds,
            rank_seconds=tuple(s.compute_seconds for s in r.ranks),
        )
        for r in reports
    ]
