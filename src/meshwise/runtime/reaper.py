"""A watchdog that outlives ``meshwise run`` and kills what its workers left behind if it dies uncleanly.

The launcher tears worker process groups down itself on every path it controls (failure, Ctrl-C,
SIGTERM, timeouts). SIGKILL (an OOM kill, ``kill -9``, a CI runner's hard timeout) gives it no chance:
the parent-death signal set by the worker guard stops each worker, but not what the worker started
(DataLoader workers, shell pipelines, ``sleep``), which would be reparented and live on.

The reaper is a tiny separate process in its own session, so neither a terminal's Ctrl-C nor a signal to
the launcher's process group reaches it. The launcher tells it, over a pipe, each worker process group it
starts (``+pgid``) and each one it has finished tearing down (``-pgid``). When the pipe closes, the
launcher is gone: on a clean exit every group has been reported finished and the reaper just exits; after
a SIGKILL it kills every group still listed.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

# Run as ``python -S -c _REAPER``, its standard input the pipe from the launcher.
_REAPER = (
    "import os, signal, sys\n"
    "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):\n"
    "    signal.signal(s, signal.SIG_IGN)\n"  # only the launcher's end of the pipe ends this process
    "groups = set()\n"
    "for line in sys.stdin:\n"
    "    (groups.add if line[0] == '+' else groups.discard)(int(line[1:]))\n"
    "for pgid in groups:\n"
    "    try:\n"
    "        os.killpg(pgid, signal.SIGKILL)\n"
    "    except OSError:\n"
    "        pass\n"
)


class Reaper:
    """The launcher's side of the watchdog: start it, report groups, close it when all are torn down."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-S", "-c", _REAPER],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
        )

    def _send(self, line: str) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):  # a reaper killed by hand must not break the launch
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def track(self, pgid: int) -> None:
        """A worker group has started: kill it if the launcher dies before it is torn down."""
        self._send(f"+{pgid}")

    def release(self, pgid: int) -> None:
        """A worker group has been torn down (its leader reaped): nothing left to kill."""
        self._send(f"-{pgid}")

    def close(self) -> None:
        """End the watchdog after a clean teardown (every group released)."""
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        self.proc.wait()
