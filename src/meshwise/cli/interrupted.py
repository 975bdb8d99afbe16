"""How a training command ends when it is stopped: SIGTERM as SIGINT, and what was kept.

SLURM's ``scancel``, Kubernetes and ``timeout`` stop a job with SIGTERM, a terminal with SIGINT; both
now unwind the same way (the ranks spawned here are stopped by the spawner's cleanup on the way up)
and end in the same one line, which says which checkpoint survived. Whatever stopped the run —
a signal, its deadline, a failed rank — the ``--json`` file is still written, marked
``"complete": false``, with the steps the ``--metrics`` stream (or else the checkpoint) recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from meshwise.train.metrics_stream import read_stream


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where SIGINT raises KeyboardInterrupt so that both unwind alike."""


@contextlib.contextmanager
def stop_signals(received: list[signal.Signals]) -> Iterator[None]:
    """Within the body, SIGTERM raises :class:`Terminated` and SIGINT KeyboardInterrupt (when it is
    not ignored), and each signal received is appended to ``received``. The record is what the
    caller trusts: what an interrupt unwinds through may wrap it in another exception (torch's
    checkpoint writer turns it into a ``CheckpointException``, or a ``RuntimeError`` from a stream it
    cut short). Off the main thread, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: object) -> None:
        received.append(signal.Signals(signum))
        raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt

    watched = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not ignored by our parent
        watched.append(signal.SIGINT)
    previous = {sig: signal.signal(sig, stop) for sig in watched}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def kept_checkpoint(checkpoint: str | None) -> tuple[str, dict[str, Any] | None]:
    """(a clause saying which checkpoint survived, the GPT checkpoint's run record or None)."""
    if checkpoint is None:
        return "no checkpoint was asked for (--checkpoint DIR keeps one)", None
    run_file = Path(checkpoint) / "run.json"  # every trainer's pointer to its latest complete step
    if run_file.is_file():
        with contextlib.suppress(ValueError, OSError):
            run = json.loads(run_file.read_text())
            kept = f"the checkpoint of step {run['step']} in {checkpoint} is kept (--resume continues it)"
            return kept, run
    return f"no checkpoint was written to {checkpoint} yet", None


def stopped_line(command: str, sig: signal.Signals, checkpoint: str | None) -> str:
    """``meshwise train gpt: SIGTERM received, stopped; the checkpoint of step 40 in DIR is kept …``
    (without a ``--checkpoint``, only the first part)."""
    stopped = f"meshwise {command}: {sig.name} received, stopped"
    return stopped if checkpoint is None else f"{stopped}; {kept_checkpoint(checkpoint)[0]}"


def write_incomplete_json(args: argparse.Namespace, stopped: str) -> None:
    """Write ``--json`` for a run that did not finish: what stopped it, its settings, its steps so far
    (from ``--metrics``, else from the checkpoint's history). Best effort: the run's own report has
    already been printed, and a failed write must not hide it."""
    path = getattr(args, "json", None)
    if path is None or path == "-":
        return
    metrics = getattr(args, "metrics", None)
    _clause, run = kept_checkpoint(getattr(args, "checkpoint", None))
    history = read_stream(metrics) if metrics and Path(metrics).is_file() else (run or {}).get("history", [])
    settings = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}
    record = {
        "complete": False,
        "stopped": stopped,
        "checkpoint_step": None if run is None else run.get("step"),
        "settings": settings,
        "history": history,
    }
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps(record, indent=2) + "\n")
