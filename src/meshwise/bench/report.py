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

from meshwise.bench.runner import Figures, Row, RunResult

KEY_COLUMNS = ("size(B)", "count(elements)", "type", "redop", "root")
FIGURE_COLUMNS = ("time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong")
#: Header line of each group of figures, as nccl-tests labels its two halves.
GROUPS = ("out-of-place", "in-place")
#: Every column of a row, in order: the key, then the out-of-place and the in-place figures.
COLUMNS = KEY_COLUMNS + FIGURE_COLUMNS + FIGURE_COLUMNS


def run_title(run: RunResult) -> str:
    ranks = f"{run.world_size} rank{'' if run.world_size == 1 else 's'}"
    return f"{run.collective} · backend {run.backend} · algorithm {run.algorithm} · {ranks}"


def _figure_cells(figures: Figures, checked: bool) -> list[str]:
    return [
        f"{figures.time_us:.1f}",
        f"{figures.algbw:.3f}",
        f"{figures.busbw:.3f}",
        str(figures.wrong) if checked else "N/A",
    ]


def run_table(run: RunResult, *, checked: bool = True) -> Table:
    """The table of one run, out-of-place then in-place figures per row as nccl-tests prints them;
    ``#wrong`` reads N/A when the run was not checked (``-c 0``)."""
    table = Table(title=run_title(run), box=box.SIMPLE_HEAD, title_justify="left")
    for name in KEY_COLUMNS:
        table.add_column(f"\n{name}", justify="left" if name in ("type", "redop") else "right")
    for group in GROUPS:
        for i, name in enumerate(FIGURE_COLUMNS):
            table.add_column(f"{group if i == 0 else ''}\n{name}", justify="right")
    for row in run.rows:
        table.add_row(*row_cells(row, checked=checked))
    return table


def row_cells(row: Row, *, checked: bool = True) -> tuple[str, ...]:
    """The cells of one row, in :data:`COLUMNS` order (the tables and the live lines share them)."""
    keys = (str(row.size), str(row.count), row.type, row.redop, str(row.root))
    return keys + tuple(cell for figures in row.placements for cell in _figure_cells(figures, checked))


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
        print_table(run_table(run, checked=checked), console)
        console.print(footer(run, checked=checked), highlight=False)
        console.print()


def print_table(table: Table, console: Console) -> None:
    """Print ``table`` without the padding rich adds up to the console width (a table in a log or a
    file would otherwise end every line with up to a hundred spaces)."""
    with console.capture() as captured:
        console.print(table)
    text = "\n".join(line.rstrip() for line in captured.get().splitlines())
    console.print(text, highlight=False, markup=False, soft_wrap=True)


def output_console() -> Console:
    """Plain stdout (no escape codes: tables end up in job logs, and mpirun hands ranks a pty), at least
    120 columns wide so the nine columns never fold, 160 when stdout is a pipe or a file."""
    probe = Console()
    width = max(probe.width, 120) if probe.is_terminal else 160
    return Console(highlight=False, color_system=None, width=width)
