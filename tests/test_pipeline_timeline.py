"""Timeline from the simulator's own unit-time events: the measured bubble must equal the predicted one."""

from __future__ import annotations

import json

import pytest

from meshwise.parallel.pipeline_parallel import Event, build_schedule, simulate, theoretical_bubble
from meshwise.parallel.pipeline_parallel.schedules import COMPUTE, Op
from meshwise.parallel.pipeline_parallel.simulator import cost
from meshwise.parallel.pipeline_parallel.timeline import (
    draw,
    measured_bubble,
    message_hops,
    replay,
    write_trace,
)


def _unit_time_events(name: str, p: int, m: int, v: int = 1) -> list[Event]:
    """Events of a dependency-respecting, as-soon-as-possible run with the simulator's unit costs."""
    schedule = build_schedule(name, p, m, v)
    finish: dict[tuple[str, int, int], float] = {}
    clock, events, position = [0.0] * p, [], [0] * p
    while any(position[r] < len(schedule.ranks[r]) for r in range(p)):
        for r in range(p):
            program = schedule.ranks[r]
            while position[r] < len(program):
                ins = program[position[r]]
                if ins.op in COMPUTE:
                    deps = []
                    if ins.op is Op.FORWARD and ins.chunk > 0:
                        deps.append(("F", ins.micro_batch, ins.chunk - 1))
                    if ins.op is Op.BACKWARD and ins.chunk < p - 1:
                        deps.append(("B", ins.micro_batch, ins.chunk + 1))
                    if any(d not in finish for d in deps):
                        break
                    start = max([clock[r], *(finish[d] for d in deps)])
                    clock[r] = start + cost(ins.op, schedule.split_backward)
                    finish[(ins.op.value, ins.micro_batch, ins.chunk)] = clock[r]
                    events.append(Event(r, ins.op.value, ins.micro_batch, ins.chunk, start, clock[r]))
                position[r] += 1
    return events


@pytest.mark.parametrize(("name", "p", "m"), [("gpipe", 4, 8), ("1f1b", 3, 5), ("zb", 4, 8)])
def test_measured_bubble_of_unit_time_events_matches_simulator(name: str, p: int, m: int) -> None:
    events = _unit_time_events(name, p, m)
    assert measured_bubble(events) == pytest.approx(simulate(build_schedule(name, p, m)).bubble)
    if name != "zb":
        assert measured_bubble(events) == pytest.approx(theoretical_bubble(p, m))
    # replaying the measured op times through the schedule reproduces a perfect run
    assert replay(build_schedule(name, p, m), events).bubble == pytest.approx(measured_bubble(events))
    span = max(e.end for e in events) - min(e.start for e in events)
    assert replay(build_schedule(name, p, m), events).makespan == pytest.approx(span)
    # messages were free in this run: every hop the pipeline waited on took no time
    hops = message_hops(build_schedule(name, p, m), events)
    assert hops and max(map(abs, hops)) < 1e-9
    # the same run with rank 0 descheduled for 5 units before its first forward: a loss replay excludes
    late = [Event(e.rank, e.op, e.micro_batch, e.chunk, e.start + 5, e.end + 5) for e in events]
    late[0] = Event(0, "F", 0, 0, 0.0, 1.0)  # F0 itself ran on time; everything after it slipped by 5
    assert measured_bubble(late) > replay(build_schedule(name, p, m), late).bubble


def test_trace_file_and_diagram(tmp_path) -> None:
    events = _unit_time_events("zb", 2, 3)
    bubble = measured_bubble(events)
    events.append(Event(1, "wait", 0, 1, 0.0, 1.0))  # rank 1 waits for F0's activation: still idle time
    assert measured_bubble(events) == bubble
    write_trace(events, tmp_path / "trace.json")
    trace = json.loads((tmp_path / "trace.json").read_text())
    boxes = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(boxes) == 2 * 3 * 3 + 1  # F, B, W of 3 micro-batches on 2 ranks, and the wait
    assert {e["tid"] for e in boxes} == {0, 1}
    first = min(boxes, key=lambda e: e["ts"])
    assert (first["name"], first["ts"], first["dur"]) == ("F0", 0.0, 1e6)
    path = tmp_path / "timeline.png"
    draw(events, path, title="zb", theory=theoretical_bubble(2, 3))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_message_hops_count_only_receivers_that_sat_idle() -> None:
    """GPipe, p = 2, m = 2: F0 reaches an idle rank 1 after 0.1; F1 is ready while rank 1 still runs F0
    (not a hop: the delay is rank 1's own work); B0 reaches rank 0, idle since F1, after 0.1; B1 is ready
    while rank 0 still runs B0."""
    events = [
        Event(0, "F", 0, 0, 0.0, 1.0),
        Event(0, "F", 1, 0, 1.0, 2.0),
        Event(1, "F", 0, 1, 1.1, 2.1),
        Event(1, "F", 1, 1, 2.1, 3.1),
        Event(1, "B", 0, 1, 3.1, 5.1),
        Event(1, "B", 1, 1, 5.1, 7.1),
        Event(0, "B", 0, 0, 5.2, 7.2),
        Event(0, "B", 1, 0, 7.3, 9.3),
    ]
    assert message_hops(build_schedule("gpipe", 2, 2), events) == pytest.approx([0.1, 0.1])


def test_the_diagram_has_a_legend_readable_labels_and_chunks_under_interleaving() -> None:
    """Issue 30.9: what each box and line means is on the figure; labels at 8 pt; ``·cN`` names the chunk
    when ranks hold several (interleaved), and nothing is added when they hold one."""
    import matplotlib.pyplot as plt

    from meshwise.parallel.pipeline_parallel.timeline import LABEL_FONTSIZE, LEGEND, figure

    for name, v, chunked in (("1f1b", 1, False), ("interleaved", 2, True)):
        events = _unit_time_events(name, 2, 4, v)
        fig = figure(events, title=name)
        ax = fig.axes[0]
        assert [t.get_text() for t in ax.get_legend().get_texts()] == list(LEGEND.values())
        labels = [t for t in ax.texts]
        assert labels and all(t.get_fontsize() >= LABEL_FONTSIZE for t in labels)
        assert any("·c" in t.get_text() for t in labels) == chunked
        assert ("chunk" in ax.get_legend().get_title().get_text()) == chunked
        plt.close(fig)
