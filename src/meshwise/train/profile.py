"""Where a training step's time goes: data, forward, backward, exposed communication, optimizer, bubble.

A loop brackets its phases with :meth:`StepProfiler.phase` inside :meth:`StepProfiler.step`; phases may
nest (a strategy's ``forward``/``backward`` inside the loop's ``forward_backward``: the inner one wins).
A pipeline adds its executor's instructions after the fact with :meth:`StepProfiler.record`. The
communication comes from the communicators' flight recorders (each operation's issue time and the time a
rank spent blocked in its ``wait``): blocked time is *exposed* communication, the rest of an operation's
life ran *hidden* under compute.

Every instant of a step gets exactly one label, by priority: ``bubble`` (inside the pipeline's window —
its first instruction on any rank to its last — and outside this rank's own instructions: waiting for a
neighbour is the bubble, not the network), then exposed communication, then the innermost phase, and
``other`` for what no phase covers. So the parts add up to the step time by construction; the tests
check that sum against the trainer's own clock.

The verdict rates the share of the step spent computing (forward, backward, optimizer) in the seeds'
efficiency bands (:data:`BANDS`); below 80 % the largest overhead names the bound and the knob to turn.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import statistics
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from meshwise.comm.api import Communicator, ReduceOp
from meshwise.comm.flight_recorder import FlightRecorder
from meshwise.parallel.pipeline_parallel.timeline import trace_json

#: phases a loop may bracket, in the order they are reported; exposed communication is carved out.
#: ``forward_backward`` is a step whose strategy does not tell its forward from its backward.
PHASES = ("data", "forward", "backward", "forward_backward", "optimizer", "bubble")
COMPUTE = ("forward", "backward", "forward_backward", "optimizer")
#: labels of an instant, first wins (see the module docstring).
_PRIORITY = ("bubble", "comm_exposed", "data", "forward", "backward", "optimizer", "forward_backward")
#: what to change when this part dominates the overhead.
KNOBS = {
    "communication": "overlap more or send less: a larger per-rank batch (more compute per byte), another "
    "DataParallel bucket_mb, a faster backend (shm on one host, nccl on GPUs), or fewer ranks",
    "data": "feed faster: more DataLoader workers, pin_memory and prefetching, data kept in memory",
    "bubble": "shrink the pipeline bubble: more micro-batches per step (m >> p, --micro-batches) or an "
    "interleaved schedule (--schedule interleaved --virtual-stages 2)",
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
    #: a pipeline's instructions on this rank: (phase, label such as "F3", start, end)
    instructions: list[tuple[str, str, float, float]] = field(default_factory=list)
    #: the pipeline's busy window (this rank's until :meth:`StepProfiler.share_windows` widens it)
    window: tuple[float, float] | None = None
    comm: list[_Op] = field(default_factory=list)  # from the flight recorders, at the step's end


class StepProfiler:
    """Times the phases of each step; the flight recorders of ``comms`` supply the communication (mesh
    axes may share a communicator: each recorder counts once).

    ``synchronize``: a CUDA device whose queue is drained at every phase boundary — kernels run
    asynchronously, and without it a phase would be charged for the kernels its predecessor queued.
    """

    def __init__(self, comms: Iterable[Communicator], *, synchronize: torch.device | None = None) -> None:
        recorders = (getattr(comm, "recorder", None) for comm in comms)
        self.recorders = list({id(r): r for r in recorders if isinstance(r, FlightRecorder)}.values())
        self.steps: list[_Step] = []
        self._device = synchronize if synchronize is not None and synchronize.type == "cuda" else None

    def _now(self) -> float:
        if self._device is not None:
            torch.cuda.synchronize(self._device)
        return time.time()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        current = _Step(self._now())
        self.steps.append(current)
        try:
            yield
        finally:
            current.ended = self._now()
            current.comm = self._comm_between(current.started, current.ended)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        _check_phase(name)
        started = self._now()
        try:
            yield
        finally:
            self.steps[-1].phases.append((name, started, self._now()))

    def record(self, name: str, label: str, start: float, end: float) -> None:
        """An instruction that already ran in this step (a pipeline executor's timeline, wall clock)."""
        _check_phase(name)
        step = self.steps[-1]
        step.instructions.append((name, label, start, end))
        low, high = step.window or (start, end)
        step.window = (min(low, start), max(high, end))

    def share_windows(self, comm: Communicator) -> None:
        """Collective over the pipeline's ranks: every step's window becomes the whole pipeline's, so the
        idle time before this rank's first and after its last instruction counts as bubble too."""
        if comm.world_size == 1 or not self.steps:
            return
        bounds = torch.tensor(
            [[-w[0], w[1]] if w else [-float("inf"), -float("inf")] for w in (s.window for s in self.steps)],
            dtype=torch.float64,
        )
        comm.all_reduce(bounds, ReduceOp.MAX)
        for step, (low, high) in zip(self.steps, bounds.tolist(), strict=True):
            if high > -float("inf"):
                step.window = (-low, high)

    def _comm_between(self, start: float, end: float) -> list[_Op]:
        found = []
        for recorder in self.recorders:
            for record in reversed(recorder.records):
                if record.started < start:
                    break
                if record.ended is not None and record.issued is not None and record.ended <= end:
                    found.append(
                        _Op(record.fingerprint.op, record.started, record.issued, record.ended, record.waited)
                    )
        return sorted(found, key=lambda op: op.started)

    def _labelled(self, step: _Step) -> list[tuple[str, float, float]]:
        """The step cut into consecutive (label, start, end) pieces by the priority of the docstring."""
        spans = [(name, t0, t1) for name, t0, t1 in step.phases]
        spans += [(name, t0, t1) for name, _, t0, t1 in step.instructions]
        for op in step.comm:  # blocked issuing (a synchronous transport does all its work here), in wait
            spans += [
                ("comm_exposed", op.started, op.issued),
                ("comm_exposed", op.ended - op.waited, op.ended),
            ]
        if step.window is not None:
            busy = [(t0, t1) for _, _, t0, t1 in step.instructions]
            spans += [("bubble", t0, t1) for t0, t1 in _uncovered(step.window, busy)]
        return _sweep(spans, step.started, step.ended)

    def parts(self) -> list[dict[str, float]]:
        """Per step: seconds of each phase less its exposed waits, ``comm_exposed``, ``comm_hidden``
        (wall time some operation was in flight while the rank went on), ``other`` (the gaps) and
        ``step``; the parts other than ``comm_hidden`` sum to ``step``."""
        out = []
        for step in self.steps:
            parts = dict.fromkeys((*PHASES, "comm_exposed", "other"), 0.0)
            for label, t0, t1 in self._labelled(step):
                parts[label] += t1 - t0
            parts["step"] = step.ended - step.started
            # wall time, not a sum: operations in flight at once (posted receives, DDP's buckets) overlap
            in_flight = [(op.issued, op.ended - op.waited) for op in step.comm]
            idle = _uncovered((step.started, step.ended), in_flight)
            parts["comm_hidden"] = parts["step"] - sum(t1 - t0 for t0, t1 in idle)
            out.append(parts)
        return out

    def summary(self, rank: int, world_size: int, trace: str | None) -> dict:
        """The steps' :func:`breakdown` plus ``total_step_seconds``: what a run's result keeps. With a
        ``trace`` path, collectively: every rank's :meth:`events` go to rank 0 (over the control plane),
        which writes the run's one trace file there (pid = rank, tracks as :data:`TRACKS`)."""
        if trace is not None:
            gathered: list = [None] * world_size if rank == 0 else []
            dist.gather_object(self.events(rank), gathered if rank == 0 else None, dst=0)
            if rank == 0:
                events = [event for rank_events in gathered for event in rank_events]
                ranks = {pid: f"rank {pid}" for pid in range(world_size)}
                Path(trace).write_text(json.dumps(trace_json(events, ranks, TRACKS)))
        per_step = self.parts()
        return breakdown(per_step) | {"total_step_seconds": sum(p["step"] for p in per_step)}

    def idle_fractions(self) -> list[float]:
        """Per pipeline step: this rank's bubble as a share of the pipeline's window (the quantity the
        pipeline timeline reports, averaged over ranks there)."""
        fractions = []
        for step, part in zip(self.steps, self.parts(), strict=True):
            if step.window is not None and step.window[1] > step.window[0]:
                fractions.append(part["bubble"] / (step.window[1] - step.window[0]))
        return fractions

    def events(self, rank: int) -> list[dict]:
        """This rank's trace events in wall-clock seconds (``timeline.trace_json`` writes them): steps,
        phases (bubble included), blocked waits and pipeline instructions as complete events, one track
        each; communication in flight as async begin/end pairs, because operations overlap one another
        (DDP's buckets, a pipeline's posted receives) and complete events on one track must not."""
        events = []
        for index, step in enumerate(self.steps):
            events.append(_event(f"step {index}", step.started, step.ended, rank, 0))
            events += [
                _event(name, t0, t1, rank, 1) for name, t0, t1 in self._labelled(step) if name in PHASES
            ]
            for number, op in enumerate(step.comm):
                key = f"rank{rank}.step{index}.op{number}"
                common = {"name": op.name, "cat": "communication", "id": key, "pid": rank, "tid": COMM_TRACK}
                events += [{**common, "ph": "b", "ts": op.started}, {**common, "ph": "e", "ts": op.ended}]
                if op.waited > 0:
                    events.append(_event(f"wait {op.name}", op.ended - op.waited, op.ended, rank, 3))
            events += [_event(label, t0, t1, rank, 4) for _, label, t0, t1 in step.instructions]
        return events


def _check_phase(name: str) -> None:
    if name not in PHASES:
        raise ValueError(f"unknown phase {name!r}; use one of {PHASES}")


def _uncovered(window: tuple[float, float], busy: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of ``window`` that no interval of ``busy`` covers (an interval that ends before it
    starts, clocks read a hair apart, covers nothing)."""
    out, cursor = [], window[0]
    for t0, t1 in sorted(busy):
        if t0 > cursor:
            out.append((cursor, min(t0, window[1])))
        cursor = max(cursor, t0, t1)
    if cursor < window[1]:
        out.append((cursor, window[1]))
    return [(t0, t1) for t0, t1 in out if t1 > t0]


def _sweep(
    spans: Sequence[tuple[str, float, float]], start: float, end: float
) -> list[tuple[str, float, float]]:
    """Cut ``[start, end]`` at every span boundary; each piece takes the highest-priority label among the
    spans covering it, ``other`` when none does, and joins the previous piece when that has its label."""
    points = sorted({start, end, *(min(max(t, start), end) for _, t0, t1 in spans for t in (t0, t1))})
    active = dict.fromkeys(_PRIORITY, 0)
    changes: dict[float, list[tuple[str, int]]] = {}
    for label, t0, t1 in spans:
        t0, t1 = max(t0, start), min(t1, end)
        if t1 > t0:
            changes.setdefault(t0, []).append((label, 1))
            changes.setdefault(t1, []).append((label, -1))
    pieces: list[tuple[str, float, float]] = []
    for t0, t1 in itertools.pairwise(points):
        for label, delta in changes.get(t0, ()):
            active[label] += delta
        label = next((name for name in _PRIORITY if active[name] > 0), "other")
        if pieces and pieces[-1][0] == label:
            pieces[-1] = (label, pieces[-1][1], t1)
        else:
            pieces.append((label, t0, t1))
    return pieces


def _event(name: str, start: float, end: float, pid: int, tid: int) -> dict:
    return {"name": name, "ph": "X", "ts": start, "dur": end - start, "pid": pid, "tid": tid}


def breakdown(per_step: Sequence[Mapping[str, float]]) -> dict:
    """Mean seconds per part over the measured steps (the first, warm-up step left out when possible),
    their count and the verdict, as a run's JSON keeps them. Means, not medians (the key's name is older):
    means of parts add up to the mean step, medians do not."""
    measured = per_step[1:] if len(per_step) > 1 else per_step
    parts = {k: statistics.fmean(s[k] for s in measured) for k in measured[0]}
    return {"steps": len(measured), "median_seconds": parts, "verdict": verdict(parts)}


#: the overheads a step may be bound by, and the part each one is
_OVERHEADS = {"communication": "comm_exposed", "data": "data", "bubble": "bubble", "other": "other"}


def verdict(parts: Mapping[str, float], knobs: Mapping[str, str] = KNOBS) -> dict[str, float | str]:
    """The compute share of the step (``efficiency``), its ``band``, the part the step is ``bound`` by and
    the ``knob`` to turn (``knobs``: per bound part, in the command's own flags), from one step's parts or
    their mean."""
    step = parts["step"]
    efficiency = sum(parts.get(p, 0.0) for p in COMPUTE) / step if step > 0 else 0.0
    band = next(name for floor, name in BANDS if efficiency > floor or floor == 0.0)
    overhead = {bound: parts.get(part, 0.0) for bound, part in _OVERHEADS.items()}
    bound = "compute" if efficiency >= 0.80 else max(overhead, key=overhead.__getitem__)
    return {"efficiency": efficiency, "band": band, "bound": bound, "knob": knobs[bound]}


_OPTIONAL_ROWS = ("forward_backward", "bubble")


def table(profile: Mapping, knobs: Mapping[str, str] = KNOBS) -> str:
    """A :func:`breakdown` as text: mean ms and share of the step per part, then the verdict."""
    parts, step = profile["median_seconds"], profile["median_seconds"]["step"]
    rows = [*PHASES[:4], "comm_exposed", "optimizer", "bubble", "other"]
    lines = [f"step profile (mean of {profile['steps']} steps, rank 0)", f"  {'part':<18}{'ms':>9}{'%':>7}"]
    for name in rows:
        if name in _OPTIONAL_ROWS and not parts.get(name):
            continue  # no pipeline, or a strategy that splits its forward from its backward
        lines.append(f"  {name:<18}{1e3 * parts[name]:9.2f}{100 * parts[name] / step:7.1f}")
    lines.append(f"  {'step':<18}{1e3 * step:9.2f}{100.0:7.1f}")
    lines.append(f"  comm hidden under compute: {1e3 * parts['comm_hidden']:.2f} ms")
    found = verdict(parts, knobs)
    share = f"{100 * found['efficiency']:.0f} % of the step computes ({found['band']})"
    lines.append(f"verdict: {share}: {found['bound']}-bound — {found['knob']}")
    return "\n".join(lines)


#: the tracks of a rank (Chrome's thread ids); communication in flight is async, on rows of its own
COMM_TRACK = 2
TRACKS = {0: "steps", 1: "phases", COMM_TRACK: "communication (issue to completion)", 3: "blocked in wait",
          4: "pipeline instructions"}  # fmt: skip
