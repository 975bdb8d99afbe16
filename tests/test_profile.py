"""Step profile: parts add up to the measured step time; the verdict follows slowed communication or data."""

import itertools
import json
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import meshwise
from meshwise.comm.api import ChainedWork
from meshwise.comm.instrumented import InstrumentedCommunicator
from meshwise.comm.native import NativeCommunicator
from meshwise.parallel import DataParallel
from meshwise.parallel.pipeline_parallel.timeline import trace_json
from meshwise.runtime.spawn import spawn
from meshwise.train.profile import TRACKS, StepProfiler, _event, breakdown, table, verdict


def _parts(**ms):
    parts = {"data": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0, "bubble": 0.0}
    parts |= {"comm_exposed": 0.0, "other": 0.0, "comm_hidden": 0.0} | {k: v / 1e3 for k, v in ms.items()}
    parts["step"] = sum(v for k, v in parts.items() if k != "comm_hidden")
    return parts


@pytest.mark.parametrize(
    ("parts", "band", "bound"),
    [
        (_parts(forward=40, backward=58, optimizer=1, other=1), "excellent", "compute"),
        (_parts(forward=30, backward=55, comm_exposed=15), "good", "compute"),
        (_parts(forward=30, backward=40, comm_exposed=25, data=5), "acceptable", "communication"),
        (_parts(forward=10, backward=20, data=60, comm_exposed=10), "poor", "data"),
        (_parts(forward=20, backward=30, bubble=45, other=5), "poor", "bubble"),
    ],
)
def test_verdict_bands_and_bounds(parts, band, bound):
    found = verdict(parts)
    assert (found["band"], found["bound"]) == (band, bound)
    assert found["knob"] and f"{bound}-bound — {found['knob']}" in table(breakdown([parts]))


class SlowComm(NativeCommunicator):
    """gloo, but every all_reduce takes ``delay`` seconds more inside its wait (a slow network)."""

    delay = 0.0

    def _all_reduce(self, tensor, op):
        return ChainedWork(super()._all_reduce(tensor, op), lambda: time.sleep(self.delay))


def _profiled_run(comm_delay, data_delay, steps=6):
    """Train a small MLP through DataParallel over an instrumented SlowComm; the profile and wall time."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    # 100k parameters against 512 samples per rank: far more compute than bytes to reduce
    inner = SlowComm(timeout=30)
    inner.delay = comm_delay
    comm = InstrumentedCommunicator(inner)
    ddp = DataParallel(model, comm)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    profiler = StepProfiler([comm])
    inputs, targets = torch.randn(512, 128), torch.randint(0, 10, (512,))
    started = time.time()
    for _ in range(steps):
        with profiler.step():
            with profiler.phase("data"):
                time.sleep(data_delay)
                x, y = inputs.clone(), targets.clone()
            with profiler.phase("forward"):
                loss = nn.functional.cross_entropy(ddp(x), y)
            with profiler.phase("optimizer"):
                optimizer.zero_grad()
            with profiler.phase("backward"):
                loss.backward()
            with profiler.phase("optimizer"):
                optimizer.step()
    wall = time.time() - started
    per_step = profiler.parts()
    return per_step, wall, breakdown(per_step)["verdict"]["bound"]


DELAY = 0.15  # seconds added per step: more than a step of this model takes even on a crowded machine


def _three_runs():
    meshwise.init("gloo", timeout=30)
    try:
        return {
            "baseline": _profiled_run(0.0, 0.0),
            "slow comm": _profiled_run(DELAY, 0.0),
            "slow data": _profiled_run(0.0, DELAY),
        }
    finally:
        meshwise.shutdown()


def test_verdict_follows_slowed_communication_and_data():
    runs = spawn(_three_runs, 2, timeout=110)[0]
    for name, (per_step, wall, _bound) in runs.items():
        total = sum(p["step"] for p in per_step)
        assert abs(total - wall) / wall < 0.05, (name, total, wall)
        for p in per_step:  # the parts (hidden communication aside) make up each step
            summed = sum(v for k, v in p.items() if k not in ("step", "comm_hidden"))
            assert summed == pytest.approx(p["step"], rel=1e-9, abs=1e-9)
    baseline, slow_comm, slow_data = (breakdown(runs[k][0])["median_seconds"] for k in runs)
    # which part bounds the baseline depends on how crowded the machine is; the slowed parts do not
    assert runs["slow comm"][2] == "communication"
    assert runs["slow data"][2] == "data"
    assert slow_comm["comm_exposed"] >= DELAY > baseline["comm_exposed"]
    assert slow_data["data"] >= DELAY > baseline["data"]


def test_meshwise_train_profile_adds_up_and_writes_a_trace(tmp_path):
    result, trace = tmp_path / "run.json", tmp_path / "trace.json"
    args = ["train", "mlp", "-np", "2", "--backend", "gloo", "--epochs", "1", "--profile"]
    args += ["--trace", str(trace), "--json", str(result)]
    command = [sys.executable, "-m", "meshwise", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr
    assert "step profile (mean of" in done.stdout and "verdict: " in done.stdout
    run = json.loads(result.read_text())
    profile, epoch = run["profile"], run["history"][0]
    assert abs(profile["total_step_seconds"] - epoch["seconds"]) / epoch["seconds"] < 0.05
    assert profile["verdict"]["bound"] in ("compute", "communication", "data", "other")
    written = json.loads(trace.read_text())
    events = written["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    assert {"data", "forward", "backward", "optimizer", "all_reduce"} <= {e["name"] for e in events}
    _perfetto_valid(written)


def overlapping_complete_events(trace: dict) -> list[tuple[dict, dict]]:
    """Pairs of complete events that overlap on one track (pid, tid) of a written trace: what Perfetto
    refuses to draw as nested slices."""
    by_track: dict[tuple[int, int], list[dict]] = {}
    for event in trace["traceEvents"]:
        if event.get("ph") == "X":
            by_track.setdefault((event["pid"], event["tid"]), []).append(event)
    found = []
    for track in by_track.values():
        track.sort(key=lambda e: e["ts"])
        found += [(a, b) for a, b in itertools.pairwise(track) if b["ts"] < a["ts"] + a["dur"]]
    return found


def _perfetto_valid(trace: dict) -> None:
    """What Perfetto needs of a JSON trace: complete events never overlap on one track, every async
    begin has its end, and times are µs from the run's start (not 16-digit epoch microseconds)."""
    assert overlapping_complete_events(trace) == []
    timed = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    assert min(e["ts"] for e in timed) == 0 and all(e.get("dur", 0) >= 0 for e in timed)
    assert max(e["ts"] for e in timed) < 600e6 and trace["otherData"]["origin_unix_s"] > 1.6e9
    begins = {(e["pid"], e["id"]): e for e in timed if e["ph"] == "b"}
    ends = {(e["pid"], e["id"]): e for e in timed if e["ph"] == "e"}
    assert begins and begins.keys() == ends.keys()
    assert all(begins[k]["ts"] <= ends[k]["ts"] and begins[k]["name"] == ends[k]["name"] for k in begins)


def test_overlapping_operations_get_rows_of_their_own():
    """Two complete events that overlap on one track (what DDP's buckets in flight used to produce) are
    spread over two rows, and the checker finds the overlap a naive writer would leave."""
    clash = [_event("a", 10.0, 10.5, 0, 3), _event("b", 10.2, 10.7, 0, 3), _event("c", 10.6, 10.8, 0, 3)]
    assert len(overlapping_complete_events({"traceEvents": [{**e, "ts": e["ts"] * 1e6, "dur": e["dur"] * 1e6}
                                                               for e in clash]})) == 2  # fmt: skip
    written = json.loads(json.dumps(trace_json(clash, {0: "rank 0"}, TRACKS)))
    assert overlapping_complete_events(written) == []
    rows = {e["name"]: (e["tid"], e["ts"]) for e in written["traceEvents"] if e["ph"] == "X"}
    assert rows == {"a": (3, 0.0), "b": (13, pytest.approx(0.2e6)), "c": (3, pytest.approx(0.6e6))}
    names = {e["tid"]: e["args"]["name"] for e in written["traceEvents"] if e["name"] == "thread_name"}
    assert names[13] == "blocked in wait (2)"
