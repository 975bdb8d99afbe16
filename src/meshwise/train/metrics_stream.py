"""``--metrics FILE``: one JSON object per logged step, appended and flushed as the run goes.

A summary written at the end is lost with the run that never reaches it (killed, preempted, diverged);
a line per logged step survives, and is what dashboards and ``tail -f`` / ``jq`` read while the run
goes. Rank 0 writes; each line is flushed (not fsynced: a line costs microseconds, far under 1 % of a
step, see ``benchmarks/bench_metrics_stream.py``). A resumed run appends to the same file.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO, Any


class MetricsStream:
    """Appends JSON lines to ``path``; :meth:`close` when the run ends."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[str] = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """One line: ``record`` plus the wall-clock time it was written (Unix seconds)."""
        self._file.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_stream(path: str | Path) -> list[dict[str, Any]]:
    """The records of a stream file; a last line cut short by a killed writer is left out."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records
