"""Where a pipeline step's time went: Chrome/Perfetto trace, the classic diagram, the measured bubble.

:func:`trace_json` is also the step profile's trace writer (``train/profile.py``): one for both.

The trace shows compute (F, B, W) and the receive waits longer than 20 µs, so a stage stalled by its
neighbour is told apart from one with nothing scheduled; :func:`replay` and :func:`message_hops` say
what the measured bubble's excess over the theory cost.

The measured bubble is the idle share of the step, 1 − mean(busy)/span, span running from the first
instruction on any rank to the last (the events' wall-clock seconds put every rank on one time axis):
the quantity the simulator's unit-time bubble predicts.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from meshwise.comm.api import Communicator
from meshwise.parallel.pipeline_parallel.executor import Event
from meshwise.parallel.pipeline_parallel.schedules import COMPUTE, Schedule
from meshwise.parallel.pipeline_parallel.simulator import Simulation, simulate

_OPS = ("F", "B", "W", "wait")


def measured_bubble(events: Sequence[Event]) -> float:
    """Idle fraction of the step averaged over the ranks that appear in ``events`` (waiting for a
    receive counts as idle)."""
    events = [e for e in events if e.op in COMPUTE]
    if not events:
        return 0.0
    span = max(e.end for e in events) - min(e.start for e in events)
    ranks = {e.rank for e in events}
    busy = sum(e.end - e.start for e in events)
    return 1.0 - busy / (len(ranks) * span) if span > 0 else 0.0


def replay(schedule: Schedule, events: Sequence[Event]) -> Simulation:
    """What a perfect executor with free messages would do with these measured op times: its makespan
    is the floor no executor, however its messages travel, beats on these ops. Measured minus replayed
    bubble is what the run lost to messages and to time spent outside the schedule (overheads, or a busy
    machine descheduling a rank); replayed minus theory is what uneven op times (unbalanced stages,
    B ≠ 2F) cost."""
    durations = {(e.op, e.micro_batch, e.chunk): e.end - e.start for e in events if e.op in COMPUTE}
    return simulate(schedule, durations)


def message_hops(schedule: Schedule, events: Sequence[Event]) -> list[float]:
    """Seconds from the end of a compute to the start of the compute its result feeds on another rank,
    for every such pair where the receiving rank sat idle when the result was ready.

    That is the latency the pipeline itself sees per message — pack, send, transfer, wake-up, unpack —
    on its critical path; a receiver still busy with other work when the result was ready does not
    count (its delay is not the message's). An activation goes from F of chunk c to F of chunk c + 1, a
    gradient from B of chunk c + 1 to B of chunk c.
    """
    compute = sorted((e for e in events if e.op in COMPUTE), key=lambda e: (e.rank, e.start))
    index = {(e.op, e.micro_batch, e.chunk): e for e in compute}
    previous: dict[Event, Event] = {}
    for before, after in itertools.pairwise(compute):
        if before.rank == after.rank:
            previous[after] = before
    hops = []
    for e in compute:
        feeds = {"F": ("F", e.chunk + 1), "B": ("B", e.chunk - 1)}.get(e.op)
        if feeds is None or not 0 <= feeds[1] < schedule.chunks:
            continue
        if schedule.owner(feeds[1]) == schedule.owner(e.chunk):
            continue
        target = index.get((feeds[0], e.micro_batch, feeds[1]))
        if target is None:
            continue
        idle_since = previous[target].end if target in previous else float("-inf")
        if idle_since <= e.end:
            hops.append(target.start - e.end)
    return hops


def trace_json(events: Sequence[dict], processes: Mapping[int, str], tracks: Mapping[int, str]) -> dict:
    """Trace Event Format (ui.perfetto.dev, chrome://tracing) of ``events`` timed in wall-clock seconds;
    ``processes`` names each pid, ``tracks`` each tid of every one. Times become µs from the earliest
    event (its wall-clock time kept in ``otherData``): epoch microseconds are 16-digit numbers that trace
    viewers round. A complete event that would overlap an earlier one on its track (clocks sampled a hair
    apart) moves to the first free row of that track, ``tid + 10·k``: Perfetto refuses to nest them."""
    origin = min((e["ts"] for e in events), default=0.0)
    ends: dict[tuple[int, int], list[float]] = {}
    names = dict(tracks)
    placed = []
    for event in sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0.0))):
        event = {**event, "ts": (event["ts"] - origin) * 1e6}
        if "dur" in event:
            event["dur"] *= 1e6
        if event["ph"] == "X":
            row_ends = ends.setdefault((event["pid"], event["tid"]), [])
            row = next((k for k, end in enumerate(row_ends) if end <= event["ts"]), len(row_ends))
            if row == len(row_ends):
                row_ends.append(0.0)
            row_ends[row] = event["ts"] + event["dur"]
            if row:
                names[event["tid"] + 10 * row] = f"{tracks.get(event['tid'], event['tid'])} ({row + 1})"
                event["tid"] += 10 * row
        placed.append(event)
    meta = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}
        for pid, name in processes.items()
    ]
    meta += [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
        for pid in processes
        for tid, name in names.items()
    ]
    return {"traceEvents": [*meta, *placed], "displayTimeUnit": "ms", "otherData": {"origin_unix_s": origin}}


def write_trace(events: Sequence[Event], path: str | Path) -> None:
    """The pipeline's :func:`trace_json` as a file: one track per rank, one complete event per instruction."""
    boxes = [
        {"name": f"{e.op}{e.micro_batch}", "cat": e.op, "ph": "X", "pid": 0, "tid": e.rank, "ts": e.start,
         "dur": e.end - e.start, "args": {"micro_batch": e.micro_batch, "chunk": e.chunk}}
        for e in events
    ]  # fmt: skip
    tracks = {rank: f"pp rank {rank}" for rank in sorted({e.rank for e in events})}
    Path(path).write_text(json.dumps(trace_json(boxes, {0: "pipeline"}, tracks)))


#: the legend's words for each kind of box (and the receive-wait line)
LEGEND = {
    "F": "F: forward",
    "B": "B: backward (input gradient, hatched)",
    "W": "W: weight gradient (pale)",
    "wait": "waiting to receive",
}
#: how each op's box differs beside its micro-batch colour, on the diagram and in its legend
BOX_STYLE: dict[str, dict] = {"F": {}, "B": {"hatch": "//"}, "W": {"alpha": 0.45}}
#: box labels in points: readable at the saved 120 dpi
LABEL_FONTSIZE = 8


def draw(events: Sequence[Event], path: str | Path, *, title: str, theory: float | None = None) -> None:
    """Save :func:`figure` as ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(events, title=title, theory=theory)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure(events: Sequence[Event], *, title: str, theory: float | None = None):  # -> matplotlib Figure
    """One row per rank, F/B/W boxes coloured by micro-batch (B hatched, W pale), idle time left blank
    (receive waits as a thin grey line under the row), a legend of those, and each box labelled with its
    micro-batch — and its chunk under interleaving — where the box is wide enough for the label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ranks = sorted({e.rank for e in events})
    micro = max((e.micro_batch for e in events), default=0) + 1
    colours = plt.get_cmap("tab20" if micro > 10 else "tab10")
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(ranks) + 2.2))
    origin = min((e.start for e in events), default=0.0)
    span = max((e.end for e in events), default=origin) - origin
    chunked = len({(e.rank, e.chunk) for e in events if e.op != "wait"}) > len(ranks)
    # a label fits a box about its characters × 0.6 % of the axis wide (12 in at 8 pt)
    for e in events:
        left, width = (e.start - origin) * 1e3, (e.end - e.start) * 1e3
        if e.op == "wait":
            ax.plot([left, left + width], [e.rank + 0.45] * 2, color="grey", lw=2)
            continue
        ax.barh(
            e.rank,
            width,
            left=left,
            height=0.8,
            color=colours(e.micro_batch % colours.N),
            edgecolor="black",
            linewidth=0.4,
            **BOX_STYLE[e.op],
        )
        label = f"{e.op}{e.micro_batch}" + (f"·c{e.chunk}" if chunked else "")  # F3, or F3·c1 interleaved
        if width > 0 and width >= 0.006 * len(label) * span * 1e3:
            ax.text(left + width / 2, e.rank, label, ha="center", va="center", fontsize=LABEL_FONTSIZE,
                    bbox={"facecolor": "white", "alpha": 0.75, "edgecolor": "none", "pad": 0.6})  # fmt: skip
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step started")
    bubble = f"bubble measured {measured_bubble(events):.1%}"
    if theory is not None:
        bubble += f", theory {theory:.1%}"
    ax.set_title(f"{title} — {bubble}")
    handles = [
        Patch(facecolor="lightgrey", edgecolor="black", label=LEGEND[op], **BOX_STYLE[op]) for op in "FBW"
    ]
    handles.append(Line2D([], [], color="grey", lw=2, label=LEGEND["wait"]))
    note = "colour: micro-batch" + (";  label ·cN: model chunk N (interleaved)" if chunked else "")
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18),
        ncol=4,
        fontsize=8,
        title=note,
        title_fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    return fig


def gather_events(comm: Communicator, events: Sequence[Event], root: int = 0) -> list[Event] | None:
    """Every rank's events on ``root`` (``None`` elsewhere): counts first, then one gather of rows."""
    rows = torch.tensor(
        [[_OPS.index(e.op), e.micro_batch, e.chunk, e.start, e.end] for e in events], dtype=torch.float64
    ).reshape(-1, 5)
    counts = torch.zeros(comm.world_size, dtype=torch.int64)
    comm.all_gather(counts, torch.tensor([len(events)], dtype=torch.int64))
    slots = [torch.empty(int(n), 5, dtype=torch.float64) for n in counts] if comm.rank == root else None
    comm.gather(rows.contiguous(), slots, root)
    if slots is None:
        return None
    return [
        Event(rank, _OPS[int(r[0])], int(r[1]), int(r[2]), float(r[3]), float(r[4]))
        for rank, block in enumerate(slots)
        for r in block.tolist()
    ]
