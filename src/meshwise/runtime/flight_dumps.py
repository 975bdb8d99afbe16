"""The launcher's half of the flight recorder: where the ranks write their dumps, and asking for them.

``meshwise run`` gives every worker a dump directory (``MESHWISE_FLIGHT_DIR``, launcher-to-worker
plumbing like ``MASTER_ADDR``); ``meshwise.init()`` there starts a thread that dumps the rank's records
and stacks when the file ``REQUEST`` appears. When a run fails, runs past its deadline or the launcher
is interrupted, the launcher creates that file, waits a few seconds for the live ranks' dumps, and
merges them (:mod:`meshwise.runtime.hang_report`) before it terminates anyone. With several nodes, each
launcher sends its ranks' dumps to the coordinator (:mod:`meshwise.runtime.coordinator`), which merges
every node's into one report that each node keeps as its ``report.txt``.

This module knows only file names and JSON, never the comm layer (runtime/ sits below it).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from meshwise.runtime.hang_report import render, summarize

#: the worker variable naming the dump directory.
FLIGHT_DIR_ENV = "MESHWISE_FLIGHT_DIR"
#: the worker variable by which ``meshwise run --debug`` turns on ``meshwise.init(debug=...)``'s default.
DEBUG_ENV = "MESHWISE_DEBUG"
#: the request file; must equal ``meshwise.comm.flight_recorder.REQUEST_FILE``.
REQUEST_FILE = "REQUEST"
#: the merged report, written next to the dumps.
REPORT_FILE = "report.txt"
#: how long the launcher waits for the live ranks' dumps.
DUMP_WAIT_SECONDS = 5.0


def dump_path(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.json"


def request_dumps(
    directory: Path, alive: Callable[[], list[int]], reason: str, wait: float = DUMP_WAIT_SECONDS
) -> None:
    """Ask every rank for its dump; wait until each rank still ``alive()`` answered, at most ``wait`` s.

    Only ranks that announced a dump thread (``rank{r}.ready``, written by ``meshwise.init``) are waited
    for, so a script that never calls it costs the launcher nothing. Only dumps written after the
    request count for a live rank (an older one may predate its hang).
    """
    directory.mkdir(parents=True, exist_ok=True)
    asked = time.time()
    (directory / REQUEST_FILE).write_text(reason)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        answering = [r for r in alive() if (directory / f"rank{r}.ready").exists()]
        if all(_newer(dump_path(directory, r), asked) for r in answering):
            return
        time.sleep(0.05)


def _newer(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since
    except FileNotFoundError:
        return False


def load_dumps(directory: Path, ranks: range) -> dict[int, dict]:
    """rank → its dump (with its stacks text under ``"stacks"``), for the ranks that wrote one."""
    dumps: dict[int, dict] = {}
    for rank in ranks:
        path = dump_path(directory, rank)
        try:
            body = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        stacks = path.with_suffix(".stacks")
        body["stacks"] = stacks.read_text() if stacks.exists() else ""
        dumps[rank] = body
    return dumps


def load_directories(directories: Sequence[Path]) -> tuple[dict[int, dict], range]:
    """Every rank's dump found in ``directories`` (one per node, copied together or on a shared file
    system; file names carry the global rank), and the job's ranks as the dumps' world size tells.

    A rank found twice keeps its latest dump. Raises FileNotFoundError for a missing directory and
    ValueError when none holds a dump, each naming what to pass instead.
    """
    found: dict[int, dict] = {}
    for directory in directories:
        if not directory.is_dir():
            raise FileNotFoundError(f"{directory} is not a directory; pass each node's --flight-dir")
        ranks = [
            int(m.group(1)) for path in directory.glob("rank*.json") if (m := _RANK.fullmatch(path.name))
        ]
        for rank, dump in load_dumps(directory, ranks).items():
            if rank not in found or dump.get("time", 0.0) >= found[rank].get("time", 0.0):
                found[rank] = dump
    if not found:
        names = " ".join(str(d) for d in directories)
        raise ValueError(
            f"no rank*.json flight dumps in {names}; pass the --flight-dir of each node's launcher"
        )
    sizes = [rec.get("world_size", 0) for dump in found.values() for rec in dump.get("recorders", [])[:1]]
    return found, range(max([*sizes, max(found) + 1]))


_RANK = re.compile(r"rank(\d+)\.json")


class FlightCollector:
    """One launch's dump directory: reset per attempt, collected into a report on failure.

    ``keep`` (a directory the user named) is never deleted; a temporary one is removed after a run
    that needed no report.
    """

    def __init__(self, directory: str | None, ranks: range) -> None:
        self.keep = directory is not None
        self.directory = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="meshwise-flight-"))
        self.ranks = ranks
        self.reported = False

    def reset(self) -> None:
        """Forget the previous attempt's dumps and request."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in [*self.directory.glob("rank*"), self.directory / REQUEST_FILE]:
            stale.unlink(missing_ok=True)

    def gather(self, reason: str, alive: Callable[[], list[int]]) -> dict[int, dict]:
        """Ask the live ranks for their records; every dump this node's ranks wrote."""
        request_dumps(self.directory, alive, reason)
        return load_dumps(self.directory, self.ranks)

    def write_report(self, report: str, summary: Sequence[str], reason: str) -> str:
        """Keep ``report`` as ``report.txt``; the few lines for the terminal that point to it."""
        path = self.directory / REPORT_FILE
        path.write_text(report)
        self.reported = True
        lines = [f"meshwise run: flight report ({reason}):", *(f"  {line}" for line in summary)]
        lines.append(f"  full report with every rank's recent ops and Python stacks: {path}")
        return "\n".join(lines) + "\n"

    def collect(self, reason: str, alive: Callable[[], list[int]]) -> str | None:
        """Ask the live ranks for their records, merge all dumps into ``report.txt``; return the few
        lines for the terminal, or None when no rank recorded anything (it never called init)."""
        dumps = self.gather(reason, alive)
        if not dumps:
            return None
        return self.write_report(render(dumps, self.ranks, reason), summarize(dumps, self.ranks), reason)

    def close(self) -> None:
        if not self.keep and not self.reported:
            shutil.rmtree(self.directory, ignore_errors=True)
