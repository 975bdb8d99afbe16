"""``meshwise train gpt --profile / --trace / --torch-profile`` for data and pipeline parallelism.

The step's parts (hidden communication aside) must make up the step time the trainer measures itself
within 5 %; under ``--pp`` the ``bubble`` part must match the idle share the pipeline timeline reports for
the same steps (computed here from the trace's instruction events), and with one micro-batch on two
stages — half of every rank's window idle in theory — the verdict must name the bubble. The accounting
rules themselves (what wins when a wait, a bubble and a phase overlap) are checked on hand-made steps.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from meshwise.cli import main
from meshwise.parallel.pipeline_parallel.executor import Event
from meshwise.parallel.pipeline_parallel.timeline import measured_bubble
from meshwise.train.gpt import GPTTrainConfig, run_gpt_training
from meshwise.train.gpt.profiling import profile_schedule
from meshwise.train.gpt.resolve import resolve
from meshwise.train.profile import StepProfiler, _Op, _Step
from test_profile import overlapping_complete_events


def _tiny(text: str, **overrides) -> GPTTrainConfig:
    settings = {
        "config": "gpt-tiny",
        "data": text,
        "seq_len": 64,
        "global_batch": 16,
        "steps": 5,
        "warmup": 1,
        "eval_every": 5,
        "eval_windows": 4,
        "backend": "gloo",
        "nproc": 2,
        "profile": True,
    }
    return GPTTrainConfig.from_flags(**(settings | overrides))


# ---------------------------------------------------------------- accounting rules, no processes
def test_every_instant_gets_one_label_by_priority() -> None:
    profiler = StepProfiler([])
    step = _Step(0.0, 10.0)
    step.phases = [("data", 0.0, 1.0), ("forward_backward", 1.0, 8.0), ("optimizer", 8.0, 9.5)]
    # pipeline instructions at 1-3 (F) and 5-7 (B); the whole pipeline's window runs 1-7.5
    step.instructions = [("forward", "F0", 1.0, 3.0), ("backward", "B0", 5.0, 7.0)]
    step.window = (1.0, 7.5)
    profiler.steps.append(step)
    # a receive waited 3.5-5 (inside the bubble: it is the bubble), an all-reduce blocked 8.5-9.0
    # inside the optimizer phase, and 2.5-2.6 spent issuing a send inside F (blocked: communication)
    recv, send = _Op("recv", 3.0, 3.0, 5.0, 1.5), _Op("send", 2.5, 2.6, 4.0, 0.0)
    step.comm = [recv, _Op("all_reduce", 8.5, 8.5, 9.0, 0.5), send]
    (parts,) = profiler.parts()
    expected = {"data": 1.0, "forward": 1.9, "backward": 2.0, "bubble": 2.5, "comm_exposed": 0.6}
    expected |= {"forward_backward": 0.5, "optimizer": 1.0, "other": 0.5}
    for name, seconds in expected.items():
        assert parts[name] == pytest.approx(seconds), name
    assert sum(v for k, v in parts.items() if k not in ("step", "comm_hidden")) == pytest.approx(10.0)
    # in flight without blocking: 3.0-3.5 of the receive, 2.6-4.0 of the send → their union 2.6-4.0
    assert parts["comm_hidden"] == pytest.approx(1.4)
    assert profiler.idle_fractions() == [pytest.approx(2.5 / 6.5)]
    tracks = {(e["tid"], e["name"]) for e in profiler.events(rank=3)}
    assert {(0, "step 0"), (1, "bubble"), (1, "forward"), (2, "recv"), (3, "wait recv"), (4, "F0")} <= tracks
    assert (1, "comm_exposed") not in tracks  # waits have their own track


def test_torch_profile_schedule_always_records_a_step() -> None:
    assert [profile_schedule(n) for n in (1, 2, 3, 4, 10)] == [
        (0, 0, 1),
        (0, 1, 1),
        (1, 1, 1),
        (1, 1, 2),
        (1, 1, 3),
    ]


# ---------------------------------------------------------------- the trainer, two ranks per run
def _adds_up(result) -> dict:
    """The profile's mean parts; they make up the mean step, which is the trainer's own step time."""
    profile = result.profile
    parts = profile["median_seconds"]
    summed = sum(v for k, v in parts.items() if k not in ("step", "comm_hidden"))
    assert summed == pytest.approx(parts["step"], rel=1e-9)
    measured = [s.seconds for s in result.history[1:]]  # the profile leaves the first step out too
    assert profile["steps"] == len(measured)
    assert abs(parts["step"] - statistics.fmean(measured)) / statistics.fmean(measured) < 0.05
    return parts


def _trace(path: Path) -> list[dict]:
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}  # both ranks, one file
    return [e for e in events if e["ph"] == "X"]


def test_data_parallel_profile_trace_and_torch_profiler(text: str, tmp_path) -> None:
    trace, ops = tmp_path / "dp.json", tmp_path / "ops"
    result = run_gpt_training(_tiny(text, trace=str(trace), torch_profile=str(ops), micro_batch=4))
    assert result is not None
    parts = _adds_up(result)
    assert parts["forward"] > 0 and parts["backward"] > 0 and parts["bubble"] == 0
    assert parts["comm_exposed"] > 0  # DDP's last bucket is waited for at the end of backward
    assert "step profile" in result.summary() and "verdict:" in result.summary()
    kinds = {(e["tid"], e["name"]) for e in _trace(trace)}
    assert {(1, "data"), (1, "forward"), (1, "backward"), (1, "optimizer")} <= kinds
    written = json.loads(trace.read_text())
    assert ("b", "all_reduce") in {(e["ph"], e["name"]) for e in written["traceEvents"]}  # async, in flight
    assert overlapping_complete_events(written) == []
    for rank in (0, 1):  # torch.profiler: operators of the recorded steps, per rank
        events = json.loads((ops / f"rank{rank}.json").read_text())["traceEvents"]
        names = {e["name"] for e in events if e.get("cat") == "cpu_op"}
        assert {"aten::mm", "aten::addmm"} & names and any(
            n.startswith("ProfilerStep#") for n in names | {e["name"] for e in events}
        )


def test_tensor_parallel_communication_is_carved_out_of_forward_and_backward(text: str) -> None:
    result = run_gpt_training(_tiny(text, tp=2, sp=True, steps=3, eval_every=3))
    assert result is not None
    parts = _adds_up(result)
    # the tp all-reduces / all-gathers run inside forward and backward; they count as communication
    assert parts["forward"] > 0 and parts["backward"] > 0 and parts["comm_exposed"] > 0
    assert parts["bubble"] == 0


def test_pipeline_bubble_matches_the_timeline_and_sets_the_verdict(text: str, tmp_path) -> None:
    trace = tmp_path / "pp.json"
    result = run_gpt_training(_tiny(text, pp=2, micro_batches=1, trace=str(trace)))
    assert result is not None
    parts = _adds_up(result)
    assert parts["bubble"] > 0
    # one micro-batch on two stages: each rank idles half of the pipeline's window in theory
    assert result.profile["verdict"]["bound"] == "bubble", result.summary()
    instructions = [e for e in _trace(trace) if e["tid"] == 4]
    assert {e["name"][0] for e in instructions} == {"F", "B"}
    # the timeline's idle fraction of the same (measured) steps, from the instructions in the trace
    steps = sorted((e for e in _trace(trace) if e["tid"] == 0 and e["pid"] == 0), key=lambda e: e["ts"])
    fractions = []
    for step in steps[1:]:
        inside = [e for e in instructions if step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
        events = [Event(e["pid"], e["name"][0], 0, 0, e["ts"], e["ts"] + e["dur"]) for e in inside]
        fractions.append(measured_bubble(events))
    timeline = statistics.fmean(fractions)
    # equal but for a rank that entered its step after the pipeline's first instruction (descheduled)
    assert result.profile["pipeline_idle_fraction"] == pytest.approx(timeline, abs=0.05), fractions
    assert 0.25 < timeline < 0.85, fractions  # theory 0.5; a crowded machine stretches the waits


def test_trace_needs_no_pipeline_and_bad_profile_paths_fail_first(text: str, tmp_path, capsys) -> None:
    resolve(_tiny(text, trace=str(tmp_path / "t.json")))  # --trace no longer asks for --pp
    (tmp_path / "file").write_text("")
    assert main(["train", "gpt", "--torch-profile", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--torch-profile" in err[0] and "is a file; name a directory" in err[0]
    assert main(["train", "gpt", "--trace", str(tmp_path / "missing" / "t.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist; create it" in err[0]
