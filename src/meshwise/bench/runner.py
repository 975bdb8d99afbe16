"""Run one collective over a sweep of sizes on a Communicator: warm up, time, check.

Timing, as nccl-tests (``timing="loop"``, the default): the ranks meet at a barrier of the control
communicator and then at one of the communicator under test, and each rank times ``iters`` operations
back to back (device synchronised at the ends) and divides by ``iters``. The per-rank times are then
combined over ranks as nccl-tests' ``-a``: 0 rank 0's, 1 the average (nccl-tests' default), 2 the
minimum, 3 the maximum; ``time_us_min``/``time_us_max`` keep the fastest and slowest rank. Back to back,
a small message's latency is the operation's alone — what a training step issuing many collectives sees.

``timing="barrier"`` is the older mode: a barrier before every timed iteration (control, then the
communicator under test, whose barrier releases ranks closest together), each rank timing the operation
alone, the per-iteration times combined over ranks as ``-a`` says (default 3: the maximum, as an
iteration lasts until its slowest rank is done) and averaged over iterations; min and max over
iterations are kept. It shows each operation started together, but charges it the skew with which
ranks leave the barrier (about 90 µs of the 135 µs measured for a 4 KiB shm all_reduce on 2 ranks).

Checking (``checks`` ≥ 1) runs the operation again on fresh exact inputs after timing and counts wrong
elements and out-of-bounds writes on every rank; both counts are summed over ranks, so every rank
returns identical rows.

As in nccl-tests every size is measured twice, out of place and in place (:mod:`meshwise.bench.cases`),
and a rooted collective with root -1 is swept once per root; sizes too small for one element per slot
are count-0 rows (the operation still runs, on empty buffers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshwise.bench.busbw import REDUCING, ROOTED, algbw, busbw, layout_for
from meshwise.bench.cases import Case
from meshwise.comm.api import Communicator, ReduceOp

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
}
#: nccl-tests' ``-d`` spellings of our types.
DTYPE_ALIASES = {"float": "float32", "half": "float16", "double": "float64"}
#: ``root`` value that sweeps every root in turn (nccl-tests' ``-r -1``).
ALL_ROOTS = -1
#: how iterations are timed: back to back (nccl-tests), or each after a barrier (see the module doc)
TIMINGS = ("loop", "barrier")
#: nccl-tests' ``-a`` values: how the ranks' times become the reported one
AVERAGES = {0: "rank 0", 1: "average", 2: "minimum", 3: "maximum"}


def default_average(timing: str) -> int:
    """nccl-tests' average over ranks back to back; the slowest rank per barrier-started iteration."""
    return 1 if timing == "loop" else 3


@dataclass(frozen=True)
class SweepConfig:
    """What to measure: one collective over ``sizes`` (bytes requested, rounded as nccl-tests)."""

    collective: str
    sizes: tuple[int, ...]
    dtype: str = "float32"
    op: str = "sum"
    root: int = 0  # ALL_ROOTS: every root in turn
    iters: int = 20
    warmup: int = 5
    checks: int = 1
    timing: str = "loop"
    average: int = 1  # nccl-tests' -a (see AVERAGES)
    skew: int = 1  # all_to_all: rank 0 exchanges this many slots with every other rank (busbw.Layout)
    #: Test hook: this rank corrupts one element of its result before every check (None: no one does).
    corrupt_rank: int | None = None


def describe_timing(config: SweepConfig) -> str:
    """What ``time_us`` means for ``config``, in words (the table's header and the JSON record)."""
    over = f"{AVERAGES[config.average]} over ranks (-a {config.average})"
    if config.timing == "loop":
        return f"time = {config.iters} operations back to back / {config.iters}; {over}"
    return f"time = mean over iterations of the {over}; a barrier before each iteration"


@dataclass(frozen=True)
class Figures:
    """One placement's measurement of a row (times in µs, bandwidths in GB/s = 1e9 B/s)."""

    time_us: float
    algbw: float
    busbw: float
    wrong: int
    out_of_bounds: int
    time_us_min: float  # loop timing: the fastest rank; barrier timing: the fastest iteration
    time_us_max: float  # loop timing: the slowest rank; barrier timing: the slowest iteration


@dataclass(frozen=True)
class Row:
    """One line of the nccl-tests table: the operation out of place and in place."""

    size: int
    count: int
    type: str
    redop: str
    root: int
    out_of_place: Figures
    in_place: Figures

    @property
    def placements(self) -> tuple[Figures, Figures]:
        return self.out_of_place, self.in_place

    @property
    def wrong(self) -> int:
        return sum(f.wrong for f in self.placements)

    @property
    def out_of_bounds(self) -> int:
        return sum(f.out_of_bounds for f in self.placements)

    @property
    def fastest_us(self) -> float:
        """The fastest figure of either placement (a rank's back-to-back average, or one barrier-started
        iteration): what the transport can do at this size."""
        return min(f.time_us_min for f in self.placements)


def sweep_roots(config: SweepConfig, world_size: int) -> tuple[int, ...]:
    """The roots a sweep visits: every rank for ``ALL_ROOTS`` on a rooted collective, else one (-1 for
    a collective without a root, as nccl-tests prints it)."""
    if config.collective not in ROOTED:
        return (-1,)
    return tuple(range(world_size)) if config.root == ALL_ROOTS else (config.root,)


def sweep_length(config: SweepConfig, world_size: int) -> int:
    """Rows a sweep produces (what a progress bar counts)."""
    return len(config.sizes) * len(sweep_roots(config, world_size))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(case: Case, control: Communicator, iters: int, device: torch.device) -> torch.Tensor:
    """Per-iteration seconds of this rank, each iteration started together after a barrier."""
    times = torch.empty(iters, dtype=torch.float64)
    for i in range(iters):
        control.barrier()
        case.comm.barrier()
        _synchronize(device)
        start = time.perf_counter()
        case.run()
        _synchronize(device)
        times[i] = time.perf_counter() - start
    return times


def _timed_loop(case: Case, control: Communicator, iters: int, device: torch.device) -> float:
    """Seconds per operation of this rank over ``iters`` operations back to back (nccl-tests)."""
    control.barrier()
    case.comm.barrier()
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        case.run()
    _synchronize(device)
    return (time.perf_counter() - start) / iters


def over_ranks(times: torch.Tensor, average: int) -> torch.Tensor:
    """``times`` (ranks × anything) combined over ranks as nccl-tests' ``-a`` value ``average``."""
    if average == 0:
        return times[0]
    if average == 1:
        return times.mean(0)
    return times.amin(0) if average == 2 else times.amax(0)


def _rank_times(control: Communicator, mine: torch.Tensor) -> torch.Tensor:
    """Every rank's ``mine``, stacked in rank order (the same table on every rank)."""
    table = torch.empty(control.world_size * mine.numel(), dtype=mine.dtype)
    control.all_gather(table, mine.reshape(-1))
    return table.reshape(control.world_size, -1)


def run_sweep(
    comm: Communicator,
    control: Communicator,
    config: SweepConfig,
    device: torch.device,
    on_size: Callable[[int], None] | None = None,
    on_row: Callable[[Row], None] | None = None,
) -> list[Row]:
    """Measure ``config.collective`` on ``comm`` for every root and size; identical rows on every rank.

    ``control`` (same ranks, any transport) carries the barriers and the reductions of times and error
    counts, so a broken transport under test cannot corrupt its own verdict. ``on_size`` is called with
    the index of each finished row (rank 0 drives a progress bar with it), ``on_row`` with each row as
    soon as it is measured (rank 0 streams it to the printing process, so a failure later loses nothing).
    """
    if comm.world_size != control.world_size or comm.rank != control.rank:
        raise ValueError("the communicator under test and the control communicator must span the same ranks")
    dtype, op = DTYPES[config.dtype], ReduceOp(config.op)
    rows = []
    for root in sweep_roots(config, comm.world_size):
        for size in config.sizes:
            layout = layout_for(config.collective, size, comm.world_size, dtype.itemsize, config.skew)
            figures = []
            for in_place in (False, True):
                case = Case(comm, layout, dtype, op, max(root, 0), device, in_place=in_place)
                figures.append(_measure(case, control, config, device))
            redop = config.op if config.collective in REDUCING else "none"
            rows.append(Row(layout.nbytes, layout.count, config.dtype, redop, root, *figures))
            if on_row is not None:
                on_row(rows[-1])
            if on_size is not None:
                on_size(len(rows) - 1)
    return rows


def _measure(case: Case, control: Communicator, config: SweepConfig, device: torch.device) -> Figures:
    """Warm up, time and check one placement of one row."""
    comm = case.comm
    case.prepare(None)
    for _ in range(config.warmup):
        case.run()
    _synchronize(device)
    if config.timing == "loop":
        mine = torch.tensor([_timed_loop(case, control, config.iters, device)], dtype=torch.float64)
        per_rank = _rank_times(control, mine)[:, 0]
        seconds = float(over_ranks(per_rank, config.average))
        fastest, slowest = float(per_rank.min()), float(per_rank.max())
    else:
        times = over_ranks(_rank_times(control, _timed(case, control, config.iters, device)), config.average)
        seconds, fastest, slowest = float(times.mean()), float(times.min()), float(times.max())
    counts = torch.zeros(2, dtype=torch.int64)
    for check in range(config.checks):
        case.prepare(salt=check + 1)
        case.run()
        _synchronize(device)
        wrong, oob = case.check(check + 1, corrupt=config.corrupt_rank == comm.rank)
        counts += torch.tensor([wrong, oob], dtype=torch.int64)
    control.all_reduce(counts, ReduceOp.SUM)
    return Figures(
        time_us=seconds * 1e6,
        algbw=algbw(case.layout.nbytes, seconds),
        busbw=busbw(case.layout.collective, case.layout.nbytes, seconds, comm.world_size),
        wrong=int(counts[0]),
        out_of_bounds=int(counts[1]),
        time_us_min=fastest * 1e6,
        time_us_max=slowest * 1e6,
    )


@dataclass(frozen=True)
class RunResult:
    """All rows of one collective on one backend with one algorithm."""

    collective: str
    backend: str
    algorithm: str
    world_size: int
    rows: tuple[Row, ...]

    @property
    def avg_busbw(self) -> float:
        """nccl-tests' footer figure: the mean busbw over every row's out-of-place and in-place figures
        (count-0 rows included, as there)."""
        figures = [f for row in self.rows for f in row.placements]
        return sum(f.busbw for f in figures) / len(figures) if figures else 0.0

    @property
    def wrong(self) -> int:
        return sum(r.wrong for r in self.rows)

    @property
    def out_of_bounds(self) -> int:
        return sum(r.out_of_bounds for r in self.rows)

    @property
    def ok(self) -> bool:
        return self.wrong == 0 and self.out_of_bounds == 0
