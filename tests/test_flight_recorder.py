"""Flight recorder: bounded records, the merged hang report, and `meshwise run` writing it on a hang."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from meshwise.comm import flight_recorder
from meshwise.comm.fingerprint import Fingerprint
from meshwise.comm.flight_recorder import FlightRecorder
from meshwise.runtime import flight_dumps
from meshwise.runtime.hang_report import main_thread_line, render, summarize


def test_launcher_and_ranks_agree_on_the_request_file():
    assert flight_dumps.REQUEST_FILE == flight_recorder.REQUEST_FILE  # runtime/ cannot import comm/


def test_the_ring_keeps_the_last_operations_only():
    recorder = FlightRecorder("world", 0, 2, capacity=3)
    for seq in range(1, 6):
        record = recorder.start(Fingerprint(seq, "barrier"))
        FlightRecorder.complete(record)
    assert [r["seq"] for r in recorder.to_json()["records"]] == [3, 4, 5]
    records = recorder.to_json()["records"]
    assert all(r["state"] == "completed" and r["ended"] >= r["started"] for r in records)


def _dump(rank, ops, stacks="", now=100.0):
    records = [
        {"seq": seq, "call": call, "site": site, "state": state, "started": 90.0, "ended": None}
        for seq, call, site, state in ops
    ]
    recorder = {"group": "world", "rank": rank, "world_size": 4, "records": records}
    return {"rank": rank, "reason": "test", "time": now, "recorders": [recorder], "stacks": stacks}


STACKS = """Thread 0x1 (most recent call first):
  File "/usr/lib/python3/threading.py", line 331 in wait

Current thread 0x2 (most recent call first):
  File "/home/u/model.py", line 91 in forward
  File "/home/u/train.py", line 12 in <module>
"""


def test_report_says_who_is_behind_and_where():
    done = (56, "all_reduce(float32[10], sum)", "model.py:88", "completed")
    waiting = (57, "all_reduce(float32[1024], sum)", "train.py:42", "started")
    dumps = {r: _dump(r, [done, waiting]) for r in (0, 1, 3)}
    dumps[2] = _dump(2, [done], stacks=STACKS)
    assert main_thread_line(STACKS) == "model.py:91 in forward"
    assert summarize(dumps, range(4)) == [
        "ranks 0,1,3 wait in all_reduce(float32[1024], sum) #57 at train.py:42 (for 10.0 s)",
        "rank 2 never entered collective #57: its last op was all_reduce(float32[10], sum) #56 at "
        "model.py:88 (completed); it is now at model.py:91 in forward",
    ]
    text = render(dumps, range(4), "rank 0 failed")
    assert "== rank 2" in text and 'File "/home/u/model.py", line 91 in forward' in text


def test_report_names_silent_ranks_and_mismatched_calls():
    dumps = {
        0: _dump(0, [(3, "all_reduce(float32[4], sum)", "a.py:1", "started")]),
        1: _dump(1, [(3, "broadcast(float32[4], root=0)", "a.py:2", "started")]),
    }
    lines = summarize(dumps, range(3))
    assert "the ranks called different operations as collective #3: a mismatch" in lines
    assert lines[-1].startswith("rank 2 sent no records")


HANG = """
import sys, time, pathlib, torch, meshwise
world = meshwise.init("gloo", timeout=float(sys.argv[1]))
world.comm.all_reduce(torch.ones(4))
if world.rank == 1:
    pathlib.Path(sys.argv[2]).write_text("asleep")
    time.sleep(300)
world.comm.all_reduce(torch.ones(8))
meshwise.shutdown()
"""


def _run(args, **kw):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen(
        [sys.executable, "-m", "meshwise", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kw,
    )


def test_a_hung_rank_is_named_after_the_timeout_in_debug_mode(tmp_path: Path):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(HANG))
    flight = tmp_path / "flight"
    started = time.monotonic()
    proc = _run(["-np", "2", "--debug", "--flight-dir", str(flight), str(script), "3", str(tmp_path / "m")])
    _, err = proc.communicate(timeout=100)
    assert proc.returncode == 1
    assert time.monotonic() - started < 90
    # the debug check times out first and names the absent rank and its last collective; the user's
    # collectives are numbered from 1 by all three (meshwise.init's own setup is numbered apart)
    assert "debug mode: rank 1 did not reach collective #2 (all_reduce(float32[8], sum) at hang.py:8)" in err
    assert "rank 1 last posted all_reduce(float32[4], sum) at hang.py:4 (#1)" in err
    assert "rank 0 failed in all_reduce(float32[8], sum) #2 at hang.py:8" in err
    assert "rank 1 never entered collective #2: its last op was all_reduce(float32[4], sum) #1" in err
    assert "it is now at hang.py:7 in <module>" in err
    report = (flight / "report.txt").read_text()
    assert "== rank 0" in report and "== rank 1" in report and "stacks:" in report
    assert re.search(r"#1 completed +all_reduce\(float32\[4\], sum\) at hang\.py:4", report)
    # and `meshwise hang-report` over the same dumps says the same
    merged = subprocess.run(
        [sys.executable, "-m", "meshwise", "hang-report", str(flight)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=60,
    )
    never = "rank 1 never entered collective #2: its last op was all_reduce(float32[4], sum) #1"
    assert never in merged.stdout


def test_the_report_is_written_when_the_launcher_is_interrupted(tmp_path: Path):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(HANG))
    flight, marker = tmp_path / "flight", tmp_path / "asleep"
    proc = _run(["-np", "2", "--flight-dir", str(flight), str(script), "120", str(marker)])
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), "rank 1 never got past the first all_reduce"
    time.sleep(1.0)  # let rank 0 enter its wait
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT
    assert "flight report (the launcher received SIGINT)" in err
    assert re.search(r"rank 0 waits in all_reduce\(float32\[8\], sum\) #2 at hang\.py:8", err)
    assert "rank 1 never entered collective #2: its last op was all_reduce(float32[4], sum) #1" in err
    assert (flight / "report.txt").exists()


def test_the_place_of_a_rank_is_below_the_report_plumbing():
    # a job deadline's handler asks for the dumps from the main thread, wherever that thread was
    stacks = """Current thread 0x2 (most recent call first):
  File "/x/site-packages/meshwise/runtime/flight_dumps.py", line 59 in request_dumps
  File "/x/site-packages/meshwise/runtime/deadline.py", line 70 in expire
  File "/home/u/train.py", line 11 in stuck
  File "/home/u/train.py", line 20 in <module>
"""
    assert main_thread_line(stacks) == "train.py:11 in stuck"


def test_every_new_request_is_answered(tmp_path: Path):
    server = flight_recorder.serve_dump_requests(tmp_path, 0)
    try:
        for reason in ("a job deadline", "the launcher"):
            (tmp_path / flight_recorder.REQUEST_FILE).write_text(reason)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                with contextlib.suppress(FileNotFoundError, ValueError):
                    if json.loads((tmp_path / "rank0.json").read_text())["reason"] == reason:
                        break
                time.sleep(0.05)
            else:
                raise AssertionError(f"no dump for the request of {reason}")
    finally:
        server.stop()
    assert flight_recorder.dump("after stop") is None  # nothing written where nobody asks any more


def test_a_run_deadline_as_long_as_the_wait_timeout_names_the_hung_rank(tmp_path: Path):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(HANG))
    # the launcher's deadline starts before any wait: it passes first, and its report says where
    proc = _run(["-np", "2", "--timeout", "10", str(script), "10", str(tmp_path / "m")])
    _, err = proc.communicate(timeout=100)
    assert proc.returncode == 124
    assert "meshwise run: workers still running after 10 s; terminating them" in err
    assert "flight report (workers still running after the 10 s deadline)" in err
    assert re.search(r"rank 0 waits in all_reduce\(float32\[8\], sum\) #2 at hang\.py:8 \(for ", err), err
    assert "rank 1 never entered collective #2: its last op was all_reduce(float32[4], sum) #1" in err
    assert "it is now at hang.py:7 in <module>" in err
