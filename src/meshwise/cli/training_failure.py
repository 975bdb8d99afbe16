"""How ``meshwise train`` and ``train gpt`` end when the run fails: one report, by the rank it concerns.

Under a launcher every rank is its own ``meshwise train`` process, so each one could print an error, and
a rank that dies usually takes its peers down with a secondary error of their own (gloo's "Connection
closed by peer" on rank 0 when rank 1 raised), which used to look like the cause. The rules here:

- a :class:`~meshwise.train.TrainingError` is reached by every rank together: rank 0 prints it, the
  others exit with the same code silently (they used to exit 0);
- any other exception is printed by the rank that raised it: its traceback, then one line naming the rank
  and the error, last, so it is also what a launcher's stderr tail ends with;
- a rank stopped because a peer left (:class:`~meshwise.comm.api.PeerFailureError`) says only that, in
  one line (the peer's own report is the one to read), and lets the peer exit first;
- ``-np N`` ranks spawned here are reported by this process (``SpawnError`` names the rank): the
  rank's traceback once, then the line naming the rank, last, as for a launched rank.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from meshwise.cli.interrupted import stop_signals, stopped_line, write_incomplete_json
from meshwise.cli.outputs import check_plot, finish_training, probe_directory, probe_file
from meshwise.comm.api import PeerFailureError
from meshwise.runtime.deadline import DEADLINE_EXIT, DeadlineExceeded
from meshwise.runtime.env import detect_launch_env
from meshwise.runtime.spawn import SpawnError
from meshwise.train.errors import TrainingError

#: How long a rank that a peer's failure stopped waits before it exits. Launchers (meshwise run,
#: torchrun) name the first rank to exit non-zero as the one that failed; the failed rank is still
#: printing its traceback and shutting down when its peers learn it left, so without this wait they
#: would exit first and be named instead. The launcher terminates the waiting rank sooner.
PEER_GRACE_SECONDS = 10.0


def run_training_command(command: str, args: argparse.Namespace, run: Callable[[], Any]) -> int:
    """Both train commands' handler body: output paths checked before any rank starts, bad input as one
    line with exit code 2, a failed run reported by :func:`report_failure`, a finished one by
    :func:`~meshwise.cli.outputs.finish_training`; a run stopped by SIGINT/SIGTERM, its deadline or a
    failure still leaves its ``--json``, marked incomplete (:mod:`meshwise.cli.interrupted`)."""
    reporter = detect_launch_env().rank == 0  # this process speaks for the job
    received: list[signal.Signals] = []  # SIGINT/SIGTERM that arrived while the run went
    try:
        check_outputs(args)
        with stop_signals(received):
            result = run()
    except (ValueError, FileNotFoundError) as exc:
        print(f"meshwise {command}: error: {exc}", file=sys.stderr)
        return 2
    except DeadlineExceeded as exc:
        print(f"meshwise {command}: error: {exc}", file=sys.stderr)
        code, stopped = DEADLINE_EXIT, str(exc)
    except BaseException as exc:  # a failed or interrupted run: one report, by the rank it concerns
        if received:  # whatever the interrupt was wrapped in on its way up
            if reporter:
                print(stopped_line(command, received[0], getattr(args, "checkpoint", None)), file=sys.stderr)
            code, stopped = 128 + received[0], f"{received[0].name} received"
        elif isinstance(exc, Exception):
            code, stopped = report_failure(command, exc), f"{type(exc).__name__}: {exc}"
        else:
            raise
    else:
        return finish_training(command, result, args.json)
    if reporter:
        write_incomplete_json(args, stopped)
    return code


#: each output flag of the train commands and how it is probed: a file, a directory, or an image file
OUTPUT_FLAGS = {
    "json": ("--json", probe_file),
    "trace": ("--trace", probe_file),
    "metrics": ("--metrics", probe_file),
    "timeline": ("--timeline", check_plot),
    "checkpoint": ("--checkpoint", probe_directory),
    "export_hf": ("--export-hf", probe_directory),
    "torch_profile": ("--torch-profile", probe_directory),
    "tensorboard": ("--tensorboard", probe_directory),
}


def check_outputs(args: argparse.Namespace) -> None:
    """Probe every output path the command was given with a real write, before any rank starts: a run
    must not train for hours and then lose its result to a path it could not write."""
    for name, (flag, probe) in OUTPUT_FLAGS.items():
        probe(flag, getattr(args, name, None))


def report_failure(command: str, exc: Exception) -> int:
    """Print ``exc`` as the rules above say (on stderr) and return the command's exit code."""
    name = f"meshwise {command}"
    if isinstance(exc, TrainingError):
        if exc.rank == 0:
            print(f"{name}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    if isinstance(exc, SpawnError):  # "rank 1 failed: …" then the rank's traceback: the traceback first
        headline, _, trace = str(exc).partition("\n")
        if trace:
            print(trace.rstrip("\n"), file=sys.stderr)
        print(f"{name}: {headline}", file=sys.stderr)
        return 1
    layout = detect_launch_env()
    who = f"rank {layout.rank}" if layout.world_size > 1 else "the run"
    if isinstance(exc, PeerFailureError):
        print(f"{name}: {who} stopped: another rank left the job (its own report says why)", file=sys.stderr)
        if layout.world_size > 1:
            time.sleep(PEER_GRACE_SECONDS)  # see PEER_GRACE_SECONDS
        return 1
    traceback.print_exception(exc, file=sys.stderr)
    print(f"{name}: {who} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return 1
