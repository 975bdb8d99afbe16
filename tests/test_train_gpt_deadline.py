"""``train gpt`` has no job deadline unless the user sets one; then exit 124 naming the flag (issue 30.1),
and where the ranks were when it passed, before any wait's own timeout (derived from the deadline) fires."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import meshwise
from gpt_cli import gpt_argv
from meshwise.cli import build_parser, main
from meshwise.comm.native import translate_error
from meshwise.runtime.deadline import DeadlineExceeded, job_deadline
from meshwise.runtime.flight_dumps import DUMP_WAIT_SECONDS, FLIGHT_DIR_ENV
from meshwise.runtime.spawn import spawn
from meshwise.runtime.timeouts import DEFAULT_TIMEOUT_S, wait_timeout
from meshwise.train.gpt import GPTTrainConfig


def test_training_has_no_job_deadline_by_default_but_keeps_the_hang_timeout():
    args = build_parser("train").parse_args(["train", "gpt"])
    assert args.timeout is None
    config = GPTTrainConfig.from_flags(timeout=args.timeout)
    assert config.mesh.comm_timeout == DEFAULT_TIMEOUT_S  # a dead peer is still named within minutes
    # each wait outlives the deadline by the time the deadline takes to collect the ranks' records
    assert GPTTrainConfig.from_flags(timeout=30.0).mesh.comm_timeout == 30.0 + DUMP_WAIT_SECONDS
    assert GPTTrainConfig.from_flags(timeout=1e6).mesh.comm_timeout == DEFAULT_TIMEOUT_S


@pytest.mark.parametrize("ranks", ["1", "2"])
def test_a_deadline_the_user_sets_names_the_flag_and_exits_124(text, capsys, ranks):
    code = main(gpt_argv(text, "-np", ranks, "--steps", "100000", "--timeout", "3"))
    assert code == 124
    err = capsys.readouterr().err
    assert "--timeout 3" in err and "Traceback" not in err


def _a_collective_that_translates_what_interrupts_it() -> None:
    """As NativeCommunicator._start does: whatever its launch raises becomes its own CommError."""
    try:
        time.sleep(30)
    except Exception as exc:
        raise translate_error(exc, 0, "all_reduce", 13.0) from exc


def test_the_deadline_ends_the_job_even_when_the_body_wraps_or_swallows_it():
    # the timer can fire inside a collective's launch (a 1-rank run is in one most of the time): the
    # communicator wraps it as "no progress within 13 s", which must not turn exit 124 into a failure
    with pytest.raises(DeadlineExceeded) as caught, job_deadline(0.2):
        _a_collective_that_translates_what_interrupts_it()
    assert str(caught.value).startswith("the job passed its --timeout 0.2 s deadline")
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded), job_deadline(0.2), contextlib.suppress(Exception):
        time.sleep(30)  # a rank's handler that returns the failure as a value
    assert time.monotonic() - started < 5


#: the deadline; each wait's timeout is derived from it as `train gpt --timeout` derives it. The ranks
#: reach the hang within a second; the rest is the wait that proves it.
SECONDS = 3.0


def _started() -> bool:
    return True


def _rank_1_hangs_after_one_all_reduce() -> None:
    world = meshwise.init("gloo", timeout=wait_timeout(SECONDS))
    try:
        world.comm.all_reduce(torch.ones(4))
        if world.rank == 1:
            time.sleep(300)  # stuck in its own code: the others wait in the next collective
        world.comm.all_reduce(torch.ones(8))
    finally:
        meshwise.shutdown()


def test_a_deadline_names_the_hung_rank_and_the_collective_before_the_wait_times_out():
    spawn(_started, 2)  # the rank server up first: the deadline then starts with the ranks, not before
    with pytest.raises(DeadlineExceeded) as caught, job_deadline(SECONDS):
        spawn(_rank_1_hangs_after_one_all_reduce, 2, timeout=120)
    message = str(caught.value)
    assert message.startswith(f"the job passed its --timeout {SECONDS:g} s deadline"), message
    site = r"(?:tests/)?test_train_gpt_deadline\.py"  # relative to the working directory
    waits = rf"rank 0 waits in all_reduce\(float32\[8\], sum\) #2 at {site}:\d+ \(for "
    assert re.search(waits, message), message
    assert re.search(
        rf"rank 1 never entered collective #2: its last op was all_reduce\(float32\[4\], sum\) #1 at "
        rf"{site}:\d+ \(completed\); it is now at {site}:\d+ in _rank_1_hangs_after_one_all_reduce",
        message,
    ), message
    assert FLIGHT_DIR_ENV not in os.environ  # the temporary dump directory is gone with the deadline


INJECT = """
    import os, sys, time
    import torch
    from meshwise.cli import main

    if os.environ["RANK"] == "1":  # rank 1's third loss never returns
        real, calls = torch.nn.functional.cross_entropy, [0]

        def stuck(*args, **kwargs):
            calls[0] += 1
            if calls[0] >= 3:
                time.sleep(300)
            return real(*args, **kwargs)

        torch.nn.functional.cross_entropy = stuck
    sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_under_meshwise_run_the_hung_rank_is_named_by_the_flight_report(text, tmp_path):
    script = tmp_path / "inject.py"
    script.write_text(textwrap.dedent(INJECT))
    # each rank's deadline starts after its imports: it covers the rendezvous, the trainer and two steps
    # (rank 1 reaches its third loss about 4 s in on 2 cores)
    argv = gpt_argv(text, "--steps", "100000", "--timeout", "10")
    flight = ["--flight-dir", str(tmp_path / "flight")]  # the report in tmp_path, not left in /tmp
    done = subprocess.run(
        [sys.executable, "-m", "meshwise", "run", "-np", "2", *flight, str(script), *argv],
        capture_output=True,
        text=True,
        timeout=110,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    err = done.stderr
    assert done.returncode == 124, err
    assert "the job passed its --timeout 10 s deadline" in err
    # rank 1 dumped its records at its deadline, before it exited: the report names where it is. Rank 0
    # is named in the all_reduce either way: waiting there (its own deadline came first) or failed in it
    # (rank 1's exit at its deadline, a few ms earlier, closed the connection under it)
    assert re.search(r"\n  rank 0 (waits|failed) in all_reduce\(float32\[\d+\], avg\) #\d+", err), err
    never = r"\n  rank 1 never entered collective #\d+: .*; it is now at inject\.py:\d+ in stuck"
    assert re.search(never, err), err
    assert "sent no records" not in err
    assert (tmp_path / "flight" / "report.txt").is_file()
