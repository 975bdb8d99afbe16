"""Flight recorder: every communicator remembers its last N operations, for the report after a hang.

After a hang the question is always "who is behind, and where": which collective each rank is waiting in
and which rank never entered it. Each :class:`FlightRecorder` keeps a bounded ring of
:class:`OpRecord` (number, fingerprint, start and end wall time, state). The records of every recorder of
the process are written as one JSON file when an operation fails (a timeout, a dead peer, a mismatch)
and when the launcher asks for them (:func:`serve_dump_requests`), together with every thread's Python
stack (faulthandler). ``meshwise run`` merges the files of all ranks into one report
(:mod:`meshwise.runtime.hang_report`).

Recording costs one small object and a deque append per operation; the dump is the slow part and only
happens on failure.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from meshwise.comm.fingerprint import Fingerprint

#: operations each communicator keeps by default.
DEFAULT_CAPACITY = 2000
#: name of the file whose appearance in the dump directory asks every rank for its records.
REQUEST_FILE = "REQUEST"
#: how often a rank looks for that request.
_POLL_SECONDS = 0.1


@dataclass(slots=True)
class OpRecord:
    """One operation: ``state`` goes started → completed, or failed with the error's first line."""

    fingerprint: Fingerprint
    started: float
    issued: float | None = None  # when the call returned to the caller (the whole op, if synchronous)
    ended: float | None = None
    waited: float = 0.0  # seconds the caller was blocked in ``wait`` (exposed communication)
    state: str = "started"
    error: str | None = None

    def to_json(self) -> dict:
        return {
            **self.fingerprint.to_json(),
            "call": self.fingerprint.describe(),
            "started": self.started,
            "issued": self.issued,
            "ended": self.ended,
            "waited": self.waited,
            "state": self.state,
            "error": self.error,
        }


class FlightRecorder:
    """The last ``capacity`` operations of one communicator (``group`` names it in the report)."""

    def __init__(self, group: str, rank: int, world_size: int, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"flight recorder capacity must be at least 1, got {capacity}")
        self.group, self.rank, self.world_size = group, rank, world_size
        self.records: deque[OpRecord] = deque(maxlen=capacity)
        _recorders.add(self)

    def start(self, fingerprint: Fingerprint) -> OpRecord:
        record = OpRecord(fingerprint, time.time())
        self.records.append(record)
        return record

    @staticmethod
    def complete(record: OpRecord) -> None:
        record.ended = time.time()
        record.state = "completed"

    @staticmethod
    def fail(record: OpRecord, error: BaseException) -> None:
        record.ended = time.time()
        record.state = "failed"
        record.error = str(error).splitlines()[0] if str(error) else type(error).__name__

    def to_json(self) -> dict:
        return {
            "group": self.group,
            "rank": self.rank,
            "world_size": self.world_size,
            "records": [r.to_json() for r in list(self.records)],
        }


_recorders: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()
_dump_lock = threading.Lock()


@dataclass
class _DumpTarget:
    directory: Path
    rank: int


_target: _DumpTarget | None = None


def configure_dumps(directory: str | os.PathLike, rank: int) -> None:
    """Write this process's dumps to ``directory/rank{rank}.json`` (and ``.stacks``) from now on."""
    global _target
    _target = _DumpTarget(Path(directory), rank)


def dump(reason: str) -> Path | None:
    """Write every recorder of this process and all Python stacks; None when no directory is configured."""
    target = _target
    if target is None:
        return None
    with _dump_lock:
        target.directory.mkdir(parents=True, exist_ok=True)
        stacks = target.directory / f"rank{target.rank}.stacks"
        with open(stacks, "w") as handle:
            faulthandler.dump_traceback(handle, all_threads=True)
        path = target.directory / f"rank{target.rank}.json"
        body = {
            "rank": target.rank,
            "pid": os.getpid(),
            "reason": reason,
            "time": time.time(),
            "recorders": [r.to_json() for r in sorted(_recorders, key=lambda r: r.group)],
        }
        partial = path.with_suffix(".json.partial")
        partial.write_text(json.dumps(body, indent=1))
        partial.replace(path)  # the launcher never reads half a file
        return path


def serve_dump_requests(directory: str | os.PathLike, rank: int) -> DumpServer:
    """Configure dumps, tell the launcher (``rank{rank}.ready``), and start a thread that dumps each time
    ``REQUEST`` is written (by the launcher, or by a job deadline).

    A thread, not a signal handler: a rank blocked inside a transport's wait never runs Python signal
    handlers on its main thread, and that rank is exactly the one whose records are needed.
    """
    configure_dumps(directory, rank)
    return DumpServer(Path(directory), rank)


class DumpServer:
    """The thread answering the launcher's dump request; :meth:`stop` when the communicator is gone."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.ready = directory / f"rank{rank}.ready"
        self.ready.touch()  # the launcher waits only for ranks that can answer
        self._request = directory / REQUEST_FILE
        self._stop = threading.Event()
        threading.Thread(target=self._watch, name="meshwise-flight-dump", daemon=True).start()

    def _watch(self) -> None:
        """Answer each request once: a new one (a job deadline's, then the launcher's) is a new file."""
        answered = None
        while not self._stop.wait(_POLL_SECONDS):
            with contextlib.suppress(OSError):
                asked = self._request.stat().st_mtime_ns
                if asked != answered:
                    answered = asked
                    dump(self._request.read_text().strip() or "requested by the launcher")

    def stop(self) -> None:
        """Stop answering, and dumping there at all (the directory may be a job's temporary one, gone
        with it); the launcher then no longer waits for this rank."""
        global _target
        self._stop.set()
        self.ready.unlink(missing_ok=True)
        if _target is not None and _target.directory == self.ready.parent:
            _target = None
