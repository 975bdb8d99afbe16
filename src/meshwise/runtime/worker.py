"""One worker process of ``meshwise run``: started in its own session, its output forwarded line by line.

The process plumbing under :mod:`meshwise.runtime.launch`: a new session per worker (so one signal to
the group reaches everything the worker started), a parent-death guard (so even a SIGKILLed launcher
leaves no workers), its stdout and stderr connected to the launcher's
:class:`~meshwise.runtime.output_pump.OutputPump` (which prefixes each line with the rank) and the stderr
tail kept for the failure report. The launcher
decides *when* to start and stop workers; this module knows *how*.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshwise.runtime.output_pump import OutputPump

#: lines of a failed rank's stderr kept for the failure report.
TAIL_LINES = 20

# Run as ``python -S -c _GUARD <launcher pid> cmd...``: die with the launcher, then become ``cmd``.
_GUARD = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"  # 1 = PR_SET_PDEATHSIG
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"  # the launcher died before the prctl took effect
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


@dataclass(frozen=True)
class WorkerExit:
    """How one worker ended: ``returncode`` < 0 means killed by that signal."""

    rank: int
    returncode: int

    @property
    def exit_status(self) -> int:
        """The shell's convention: the code itself, or 128 + signal number."""
        return self.returncode if self.returncode >= 0 else 128 - self.returncode

    def describe(self) -> str:
        if self.returncode < 0:
            try:
                return f"killed by {signal.Signals(-self.returncode).name}"
            except ValueError:
                return f"killed by signal {-self.returncode}"
        return f"exit code {self.returncode}"


class WorkerProcess:
    """One child process whose output ``pump`` forwards line by line with a rank prefix."""

    def __init__(
        self, rank: int, cmd: Sequence[str], env: Mapping[str, str], pump: OutputPump, label: str
    ) -> None:
        self.rank = rank
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        if sys.platform.startswith("linux"):
            cmd = [sys.executable, "-S", "-c", _GUARD, str(os.getpid()), *cmd]
        self.pump = pump
        out, err = pump.add(rank, label, self.tail)
        with out, err:  # the worker holds its own copies once started
            self.proc = subprocess.Popen(
                list(cmd),
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=out.fileno(),
                stderr=err.fileno(),
                start_new_session=True,
            )

    def watch(self, exits: queue.Queue[WorkerExit]) -> None:
        """Report this worker's end on ``exits`` the moment it happens."""
        threading.Thread(
            target=lambda: exits.put(WorkerExit(self.rank, self.proc.wait())), daemon=True
        ).start()

    def signal_group(self, signum: int) -> None:
        """Signal the worker's whole process group (it leads its own session, so pgid == pid)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signum)

    def drain(self, timeout: float) -> None:
        """Forward everything this exited worker wrote, so a failure report shows its last stderr lines."""
        self.pump.finish(self.rank, timeout)
