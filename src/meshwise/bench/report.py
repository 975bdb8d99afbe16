"""Human output: nccl-tests-style tables and lines per collective/backend/algorithm (live: ``live.py``).

Columns and units are nccl-tests' (size in bytes, time in µs, GB/s = 10^9 B/s) so numbers can be put
side by side with an ``all_reduce_perf`` log. The footer gives the average bus bandwidth and the result
of the checks: wrong elements and writes outside the result buffers, each ``OK`` only when zero.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich import box
from rich.console import Console
from rich.table import Table

from meshwise.bench.runner import Row, RunResult

COLUMNS = (
    "size(B)",
    "count(elements)",
    "type",
    "redop",
    "root",
    "time(us)",
    "algbw(GB/s)",
    "busbw(GB/s)",
    "#wrong",
)


def run_title(run: RunResult) -> str:
    ranks = f"{run.world_size} rank{'' if run.world_size == 1 else 's'}"
    return f"{run.collective} · backend {run.backend} · algorithm {run.algorithm} · {ranks}"


def run_table(run: RunResult, *, checked: bool = True) -> Table:
    """The table of one run; ``#wrong`` reads N/A when the run was not checked (``-c 0``)."""
    table = Table(title=run_title(run), box=box.SIMPLE_HEAD, title_justify="left")
    for name in COLUMNS:
        table.add_column(name, justify="left" if name in ("type", "redop") else "right")
    for row in run.rows:
        table.add_row(*row_cells(row, checked=checked))
    return table


def row_cells(row: Row, *, checked: bool = True) -> tuple[str, ...]:
    """The cells of one row, in :data:`COLUMNS` order (the tables and the live lines share them)."""
    return (
        str(row.size),
        str(row.count),
        row.type,
        row.redop,
        str(row.root),
        f"{row.time_us:.1f}",
        f"{row.algbw:.3f}",
        f"{row.busbw:.3f}",
        str(row.wrong) if checked else "N/A",
    )


def footer(run: RunResult, *, checked: bool = True) -> str:
    if not checked:
        verdict = "not checked (-c 0)"
        return f"# Avg bus bandwidth    : {run.avg_busbw:.3f} GB/s\n# Checks               : {verdict}"
    wrong = "OK" if run.wrong == 0 else "FAILED"
    oob = "OK" if run.out_of_bounds == 0 else "FAILED"
    return (
        f"# Avg bus bandwidth    : {run.avg_busbw:.3f} GB/s\n"
        f"# Wrong elements       : {run.wrong} {wrong}\n"
        f"# Out of bounds writes : {run.out_of_bounds} {oob}"
    )


def print_runs(runs: Sequence[RunResult], console: Console, *, checked: bool = True) -> None:
    for run in runs:
        console.print(run_table(run, checked=checked))
        console.print(footer(run, checked=checked), highlight=False)
        console.print()


def output_console() -> Console:
    """Plain stdout (no escape codes: tables end up in job logs, and mpirun hands ranks a pty), at least
    120 columns wide so the nine columns never fold, 160 when stdout is a pipe or a file."""
    probe = Console()
    width = max(probe.width, 120) if probe.is_terminal else 160
    return Console(highlight=False, color_system=None, width=width)
