"""Where a training step's time goes: data, forward, backward, exposed communication, optimizer, bubble.

A loop brackets its phases with :meth:`StepProfiler.phase` inside :meth:`StepProfiler.step`; the
communication comes from the communicator's flight recorder (each operation's issue time and the time
a rank spent blocked in its ``wait``). A wait is *exposed* communication and is taken out of the phase
it happened in (DDP waits for its last buckets at the end of backward); the rest of an operation's
life ran *hidden* under compute. Phases are consecutive, and the gaps between them are counted as
``other``, so the parts add up to the step time by construction; the tests check that sum against the
epoch's wall clock.

The verdict uses the seeds' efficiency bands for the fraction of the step spent computing (forward,
backward, optimizer): > 95 % excellent, 80–95 % good, 60–80 % acceptable, < 60 % poor. Below 80 % the
largest overhead names the bound and the knob to turn. Any loop can use it: the pipeline trainer adds a
``bubble`` phase for its idle slots.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from meshwise.comm.flight_recorder import FlightRecorder

#: phases a loop may bracket, in the order they are reported; exposed communication is carved out.
PHASES = ("data", "forward", "backward", "optimizer", "bubble")
COMPUTE = ("forward", "backward", "optimizer")
#: what to change when this part dominates the overhead.
KNOBS = {
    "communication": "overlap more or send less: a larger per-rank batch (more compute per byte), another "
    "DataParallel bucket_mb, a faster backend (shm on one host, nccl on GPUs), or fewer ranks",
    "data": "feed faster: more DataLoader workers, pin_memory and prefetching, data kept in memory",
    "bubble": "shrink the pipeline bubble: more micro-batches per step (m >> p) or an interleaved schedule",
    "other": "host overhead between phases (logging, metric syncs, lr updates): do it less often",
    "compute": "compute dominates, as it should: add ranks, use a faster device or mixed precision",
}
BANDS = ((0.95, "excellent"), (0.80, "good"), (0.60, "acceptable"), (0.0, "poor"))


@dataclass(frozen=True)
class _Op:
    """One communication operation inside a step (times from the flight recorder)."""

    name: str
    started: float
    issued: float
    ended: float
    waited: float


@dataclass
class _Step:
    started: float
    ended: float = 0.0
    phases: list[tuple[str, float, float]] = field(default_factory=list)


class StepProfiler:
    """Times the phases of each step; ``recorder`` (the communicator's) supplies the communication."""

    def __init__(self, recorder: FlightRecorder | None) -> None:
        self.recorder = recorder
        self.steps: list[_Step] = []
        self.comm: list[list[_Op]] = []  # per step

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        current = _Step(time.time())
        self.steps.append(current)
        try:
            yield
        finally:
            current.ended = time.time()
            self.comm.append(self._comm_between(current.started, current.ended))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"unknown phase {name!r}; use one of {PHASES}")
        started = time.time()
        try:
            yield
        finally:
            self.steps[-1].phases.append((name, started, time.time()))

    def _comm_between(self, start: float, end: float) -> list[_Op]:
        if self.recorder is None:
            return []
        found = []
        for record in reversed(self.recorder.records):
            if record.started < start:
                break
            if record.ended is not None and record.issued is not None and record.ended <= end:
                found.append(
                    _Op(record.fingerprint.op, record.started, record.issued, record.ended, record.waited)
                )
        return found[::-1]

    def parts(self) -> list[dict[str, float]]:
        """Per step: seconds of each phase less its exposed waits, ``comm_exposed``, ``comm_hidden``,
        ``other`` (the gaps) and ``step``; the parts other than ``comm_hidden`` sum to ``step``."""
        out = []
        for step, comm in zip(self.steps, self.comm, strict=True):
            parts = dict.fromkeys(PHASES, 0.0)
            for name, t0, t1 in step.phases:
                parts[name] += t1 - t0
            exposed = hidden = 0.0
            for op in comm:
                # blocked while issuing (a synchronous transport does all its work here) and in wait
                for blocked, at in ((op.issued - op.started, op.started), (op.waited, op.ended)):
                    exposed += blocked
                    phase = next((n for n, t0, t1 in step.phases if t0 <= at <= t1), None)
                    if phase is not None:
                        parts[phase] -= blocked
                hidden += max(0.0, op.ended - op.issued - op.waited)
            parts["comm_exposed"] = exposed
            total = step.ended - step.started
            parts["other"] = total - sum(parts.values())
            parts["comm_hidden"] = hidden
            parts["step"] = total
            out.append(parts)
        return out

    def events(self, rank: int) -> list[dict]:
        """Chrome/Perfetto trace events (µs): one track of phases and one of communication per rank."""
        events = []
        for index, (step, comm) in enumerate(zip(self.steps, self.comm, strict=True)):
            events.append(_event(f"step {index}", step.started, step.ended, rank, 0))
            events += [_event(name, t0, t1, rank, 1) for name, t0, t1 in step.phases]
            for op in comm:
                events.append(_event(op.name, op.started, op.ended, rank, 2))
                if op.waited > 0:
                    events.append(_event(f"wait {op.name}", op.ended - op.waited, op.ended, rank, 3))
        return events


def _event(name: str, start: float, end: float, pid: int, tid: int) -> dict:
    return {"name": name, "ph": "X", "ts": start * 1e6, "dur": (end - start) * 1e6, "pid": pid, "tid": tid}


@dataclass(frozen=True)
class Breakdown:
    """Mean seconds per part over the measured steps (the first, warm-up step left out when possible).

    Means, not medians: means of parts add up to the mean step, medians do not.
    """

    parts: dict[str, float]
    steps: int

    @classmethod
    def of(cls, per_step: Sequence[Mapping[str, float]]) -> Breakdown:
        measured = per_step[1:] if len(per_step) > 1 else per_step
        keys = measured[0].keys() if measured else ()
        return cls({k: statistics.fmean(s[k] for s in measured) for k in keys}, len(measured))

    def verdict(self) -> Verdict:
        return verdict(self.parts)

    def to_json(self) -> dict:
        return {"steps": self.steps, "median_seconds": self.parts, "verdict": self.verdict().__dict__}

    @classmethod
    def from_json(cls, data: Mapping) -> Breakdown:
        return cls(dict(data["median_seconds"]), int(data["steps"]))


@dataclass(frozen=True)
class Verdict:
    efficiency: float  # compute share of the step
    band: str
    bound: str
    knob: str

    def line(self) -> str:
        share = f"{100 * self.efficiency:.0f} % of the step computes ({self.band})"
        return f"{share}: {self.bound}-bound — {self.knob}"


def verdict(parts: Mapping[str, float]) -> Verdict:
    """Efficiency band and the part that bounds the step, from one step's (or the median) parts."""
    step = parts["step"]
    compute = sum(parts.get(p, 0.0) for p in COMPUTE)
    efficiency = compute / step if step > 0 else 0.0
    band = next(name for floor, name in BANDS if efficiency > floor or floor == 0.0)
    overheads = {
        "communication": parts.get("comm_exposed", 0.0),
        "data": parts.get("data", 0.0),
        "bubble": parts.get("bubble", 0.0),
        "other": parts.get("other", 0.0),
    }
    bound = "compute" if efficiency >= 0.80 else max(overheads, key=overheads.__getitem__)
    return Verdict(efficiency, band, bound, KNOBS[bound])


def table(breakdown: Breakdown) -> str:
    """The per-step breakdown as text: median ms and share of the step, then the verdict."""
    parts, step = breakdown.parts, breakdown.parts["step"]
    rows = [*PHASES[:3], "comm_exposed", "optimizer", "bubble", "other"]
    lines = [f"step profile (mean of {breakdown.steps} steps, rank 0)", f"  {'part':<14}{'ms':>9}{'%':>7}"]
    for name in rows:
        if name == "bubble" and parts[name] == 0:
            continue  # no pipeline in this loop
        lines.append(f"  {name:<14}{1e3 * parts[name]:9.2f}{100 * parts[name] / step:7.1f}")
    lines.append(f"  {'step':<14}{1e3 * step:9.2f}{100.0:7.1f}")
    lines.append(f"  comm hidden under compute: {1e3 * parts['comm_hidden']:.2f} ms")
    lines.append(f"verdict: {breakdown.verdict().line()}")
    return "\n".join(lines)


def write_trace(path: str, events: Sequence[dict]) -> None:
    """A Chrome/Perfetto trace (open it in ui.perfetto.dev or chrome://tracing): pid = rank, tracks
    0 steps, 1 phases, 2 communication in flight, 3 waits."""
    names = {0: "steps", 1: "phases", 2: "communication (issue to completion)", 3: "blocked in wait"}
    meta = [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
        for pid in sorted({e["pid"] for e in events})
        for tid, name in names.items()
    ]
    Path(path).write_text(json.dumps({"traceEvents": [*meta, *events], "displayTimeUnit": "ms"}))
