"""Results as they happen: rank 0 reports every finished size, the process that prints shows it at once.

A benchmark can run for many minutes and end badly (``--timeout``, a killed rank, Ctrl-C). Printing
everything at the end would lose every finished row with it, so rank 0 turns its progress into small
events — a run starts, a row is done, a run ends, a progress bar advances — and hands each to a sink: a
callable in the same process (one rank, or ranks started by a launcher) or the write end of a pipe to
the ``meshwise bench`` process that spawned the ranks. That process prints each row as a fixed-width line
as soon as it arrives (flushed, also into files and pipes), draws the progress bar, and keeps the rows,
so a failed run still writes the JSON of what finished.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from meshwise.bench.report import COLUMNS, GROUPS, KEY_COLUMNS, footer, row_cells, run_title
from meshwise.bench.runner import RunResult

#: ("task", id, label, total) | ("advance", id) | ("run", collective, backend, algorithm, world_size)
#: | ("row", Row) | ("end",)
Event = tuple[Any, ...]
Sink = Callable[[Event], None] | Connection

#: right-aligned column widths (key, out-of-place, in-place); type and redop are left-aligned as in the tables
_WIDTHS = (12, 15, 8, 6, 5, *(11, 11, 11, 6) * 2)
_LEFT = ("type", "redop")


def emitter(sink: Sink) -> Callable[[Event], None]:
    """A function that delivers an event to ``sink`` (a pipe is written, a callable called)."""
    return sink.send if isinstance(sink, Connection) else sink


class EventProgress:
    """Stands in for a rich ``Progress`` on rank 0: ``add_task``/``advance`` become events, so the bar is
    drawn by the process that prints the rows and the two never fight over the terminal."""

    def __init__(self, emit: Callable[[Event], None]) -> None:
        self._emit = emit
        self._next = 0

    def add_task(self, description: str, total: int) -> int:
        task, self._next = self._next, self._next + 1
        self._emit(("task", task, description, total))
        return task

    def advance(self, task: int) -> None:
        self._emit(("advance", task))


def _groups_line() -> str:
    """nccl-tests' line above the column names: where the out-of-place and the in-place figures start."""
    keys = len(KEY_COLUMNS)
    key = sum(_WIDTHS[:keys]) + 2 * keys  # the key columns and their separators
    half = sum(_WIDTHS[keys : keys + 4]) + 2 * 4
    return " " * key + GROUPS[0].ljust(half) + GROUPS[1]


def _line(cells: tuple[str, ...]) -> str:
    return "  ".join(
        cell.ljust(width) if name in _LEFT else cell.rjust(width)
        for name, cell, width in zip(COLUMNS, cells, _WIDTHS, strict=True)
    ).rstrip()


class LiveReport:
    """Prints events as they come and keeps the rows (the runs so far, the unfinished one included).

    ``header`` is printed before the first run; ``progress`` draws a transient bar on stderr (on the
    terminal's stdout when both are one terminal, so rows print above the bar instead of under it).
    """

    def __init__(self, header: str, *, checked: bool, progress: bool) -> None:
        self.header = header
        self.checked = checked
        self.runs: list[RunResult] = []
        self._started = False
        self._lock = threading.Lock()
        self._tasks: dict[int, Any] = {}
        self._progress: Progress | None = None
        if progress:
            same_terminal = sys.stdout.isatty() and sys.stderr.isatty()
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console() if same_terminal else Console(stderr=True),
                transient=True,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._to_bar = same_terminal

    def __enter__(self) -> LiveReport:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()

    @property
    def finished_rows(self) -> int:
        return sum(len(run.rows) for run in self.runs)

    def _print(self, text: str) -> None:
        if self._progress is not None and self._to_bar:
            self._progress.console.print(text, highlight=False, markup=False, soft_wrap=True)
        else:
            print(text, flush=True)

    def print_header(self) -> None:
        """The header, once (before the first run, or before the summary of a run without one)."""
        if not self._started:
            self._print(self.header + "\n")
            self._started = True

    def handle(self, event: Event) -> None:
        """Take one event (called from the pipe's reader thread or from rank 0 itself)."""
        with self._lock:
            kind = event[0]
            if kind == "task" and self._progress is not None:
                self._tasks[event[1]] = self._progress.add_task(event[2], total=event[3])
            elif kind == "advance" and event[1] in self._tasks:
                assert self._progress is not None
                self._progress.advance(self._tasks[event[1]])
            elif kind == "run":
                self.print_header()
                self.runs.append(RunResult(*event[1:], rows=()))
                self._print(run_title(self.runs[-1]))
                self._print(_groups_line())
                self._print(_line(COLUMNS))
            elif kind == "row":
                run = self.runs[-1]
                self.runs[-1] = RunResult(
                    run.collective, run.backend, run.algorithm, run.world_size, (*run.rows, event[1])
                )
                self._print(_line(row_cells(event[1], checked=self.checked)))
            elif kind == "end":
                self._print(footer(self.runs[-1], checked=self.checked) + "\n")


def pump(reader: Connection, handle: Callable[[Event], None]) -> threading.Thread:
    """Feed ``handle`` every event arriving on ``reader`` until every writer is closed (a thread)."""

    def loop() -> None:
        while True:
            try:
                event = reader.recv()
            except (EOFError, OSError):
                return
            handle(event)

    thread = threading.Thread(target=loop, name="meshwise-bench-events", daemon=True)
    thread.start()
    return thread
