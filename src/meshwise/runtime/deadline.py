"""A deadline the user set for a whole job (``--timeout``), enforced in the process that started it.

Training has no deadline unless asked for one: a run may take days, and a default one silently kills
every run longer than it. When one is set, it is armed here as a real-time timer in the main thread of
the process that owns the job: the timer raises :class:`DeadlineExceeded` wherever that process is —
computing as the single rank, or waiting for its spawned ranks, which the spawner's cleanup then
terminates on the way up — so one mechanism covers both, and the command turns it into exit code 124
(as ``meshwise run --timeout`` and coreutils' ``timeout`` do). Each wait inside the job keeps its own,
separate hang timeout (:mod:`meshwise.runtime.timeouts`).

A deadline that passes while a rank is hung must still say where: the wait timeout of the collective it
hangs in (:func:`~meshwise.runtime.timeouts.wait_timeout`, which outlives the deadline by the time the
records take) must not fire first. So before it raises, the timer asks every rank for its flight records
(:mod:`meshwise.runtime.flight_dumps`) and the message names which rank waits in which collective and
which never entered it. Under ``meshwise run`` the ranks dump into the
launcher's directory and its flight report says it (once, for the job); otherwise the ranks started here
dump into a temporary directory and the message itself carries the summary.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from meshwise.runtime.flight_dumps import FLIGHT_DIR_ENV, load_directories, request_dumps
from meshwise.runtime.hang_report import summarize

#: the exit code of a job stopped at its deadline, as coreutils' ``timeout`` and ``meshwise run``
DEADLINE_EXIT = 124


class DeadlineExceeded(Exception):
    """The job ran past the deadline its ``flag`` set; the message names the flag and the seconds, then
    where the ranks were (``where``: the flight report's summary lines, when the ranks recorded any)."""

    def __init__(self, flag: str, seconds: float, where: Sequence[str] = ()) -> None:
        message = (
            f"the job passed its {flag} {seconds:g} s deadline and was stopped; raise {flag} or leave it "
            "out (no deadline)"
        )
        if where:
            message += "; where the ranks were:\n" + "\n".join(f"  {line}" for line in where)
        super().__init__(message)
        self.flag, self.seconds, self.where = flag, seconds, list(where)


@contextlib.contextmanager
def job_deadline(seconds: float | None, flag: str = "--timeout") -> Iterator[None]:
    """Raise :class:`DeadlineExceeded` in this (main) thread if the body is still running after
    ``seconds``; ``None`` means no deadline. Off the main thread, where signals cannot be delivered,
    it does nothing (the caller's own waits still time out). The ranks the body starts (here or spawned)
    dump their flight records into ``$MESHWISE_FLIGHT_DIR``, set here for the body when no launcher
    set it."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    with _flight_directory() as (directory, ours):
        fired: list[DeadlineExceeded] = []

        def expire(_signum: int, _frame: object) -> None:
            where = _where_ranks_are(directory, flag, seconds)
            fired.append(DeadlineExceeded(flag, seconds, where if ours else ()))
            raise fired[0]

        previous = signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        except BaseException as exc:
            # the timer raises wherever the body is: inside a collective's launch the communicator wraps
            # it as its own failure (CommTimeoutError), and a rank's handler may turn that into a value
            if fired and exc is not fired[0]:
                raise fired[0] from None
            raise
        else:
            if fired:
                raise fired[0]
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _flight_directory() -> Iterator[tuple[Path, bool]]:
    """The ranks' dump directory and whether it is ours: the launcher's, else a temporary one for the
    body (removed after)."""
    given = os.environ.get(FLIGHT_DIR_ENV)
    if given:
        yield Path(given), False
        return
    directory = tempfile.mkdtemp(prefix="meshwise-deadline-")
    os.environ[FLIGHT_DIR_ENV] = directory
    try:
        yield Path(directory), True
    finally:
        os.environ.pop(FLIGHT_DIR_ENV, None)
        shutil.rmtree(directory, ignore_errors=True)


def _where_ranks_are(directory: Path, flag: str, seconds: float) -> list[str]:
    """Every answering rank's flight records dumped (this one's too: a launcher asks only once this
    process has exited); their summary, or nothing when none recorded any."""

    def answering() -> list[int]:
        return [int(p.name[4:-6]) for p in directory.glob("rank*.ready") if p.name[4:-6].isdigit()]

    if not answering():
        return []
    request_dumps(directory, answering, f"the job passed its {flag} {seconds:g} s deadline")
    try:
        dumps, ranks = load_directories([directory])
    except (ValueError, FileNotFoundError):
        return []
    return summarize(dumps, ranks)
