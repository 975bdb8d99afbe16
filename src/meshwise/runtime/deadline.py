"""A deadline the user set for a whole job (``--timeout``), enforced in the process that started it.

Training has no deadline unless asked for one: a run may take days, and a default one silently kills
every run longer than it. When one is set, it is armed here as a real-time timer in the main thread of
the process that owns the job: the timer raises :class:`DeadlineExceeded` wherever that process is —
computing as the single rank, or waiting for its spawned ranks, which the spawner's cleanup then
terminates on the way up — so one mechanism covers both, and the command turns it into exit code 124
(as ``meshwise run --timeout`` and coreutils' ``timeout`` do). Each wait inside the job keeps its own,
separate hang timeout (:mod:`meshwise.runtime.timeouts`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

#: the exit code of a job stopped at its deadline, as coreutils' ``timeout`` and ``meshwise run``
DEADLINE_EXIT = 124


class DeadlineExceeded(Exception):
    """The job ran past the deadline its ``flag`` set; the message names the flag and the seconds."""

    def __init__(self, flag: str, seconds: float) -> None:
        super().__init__(
            f"the job passed its {flag} {seconds:g} s deadline and was stopped; raise {flag} or leave it "
            "out (no deadline)"
        )
        self.flag, self.seconds = flag, seconds


@contextlib.contextmanager
def job_deadline(seconds: float | None, flag: str = "--timeout") -> Iterator[None]:
    """Raise :class:`DeadlineExceeded` in this (main) thread if the body is still running after
    ``seconds``; ``None`` means no deadline. Off the main thread, where signals cannot be delivered,
    it does nothing (the caller's own waits still time out)."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(_signum: int, _frame: object) -> None:
        raise DeadlineExceeded(flag, seconds)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
