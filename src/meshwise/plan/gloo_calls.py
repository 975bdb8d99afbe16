"""What one gloo collective call costs on this host, measured now, per collective and group size.

The ``cpu`` preset prices every call a layout makes (a tensor-parallel all-gather, a ZeRO reduce-scatter,
the gradient all-reduce) as α + β·bytes with the α, β *of that collective on that many endpoints* — not
one link pushed through the ring formulas: gloo's reduce-scatter is an all-reduce underneath, its
all-gather a different pattern again, and on a 2-core host 4 endpoints are not twice 2. Endpoints are
threads of this process, each with its own gloo process group over a file store (loopback TCP, as local
ranks talk), and *all* of the layout's ranks take part at once: a dp2·tp2 layout's two tp groups talk
together, so an entry for groups of ``g`` among ``ranks`` is timed with ``ranks / g`` groups side by
side. Sizes go up to 32 MiB so that β is identifiable (:func:`~meshwise.comm.cost.fit.fit_call_cost`
refuses to guess it from small calls).
"""

from __future__ import annotations

import datetime
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: collectives the planner prices per call (bytes as the cost formulas count them: the full vector for
#: all_reduce, all slots together for all_gather / reduce_scatter, one rank's input for all_to_all)
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
#: bytes per call measured: tensor-parallel activations are 10⁵–10⁶, a gradient bucket 10⁷
SIZES = (2**16, 2**20, 2**23, 2**25)


@dataclass(frozen=True)
class CallCost:
    """Seconds of one ``collective`` call on a group of ``group`` ranks: ``alpha + beta · bytes``."""

    collective: str
    group: int
    alpha: float
    beta: float

    def seconds(self, nbytes: float) -> float:
        return self.alpha + self.beta * nbytes


def measure_calls(ranks: int, runs: int = 3, sizes: tuple[int, ...] = SIZES) -> tuple[CallCost, ...]:
    """A :class:`CallCost` per collective and group size dividing ``ranks`` (2 and up), measured now.

    Raises RuntimeError (naming the collective and group) when gloo does not finish in 60 s, and
    ValueError from the fit when β cannot be told from noise even after one more try with three times
    the runs (a host whose other jobs stall every call for milliseconds)."""
    costs = []
    for group in (g for g in range(2, ranks + 1) if ranks % g == 0):
        for collective in COLLECTIVES:
            costs.append(_measure(collective, group, ranks, sizes, runs))
    return tuple(costs)


def _measure(collective: str, group: int, ranks: int, sizes: tuple[int, ...], runs: int) -> CallCost:
    from meshwise.comm.cost.fit import fit_call_cost  # numpy: only a measurement pays for it

    try:
        seconds = _time_calls(collective, group, ranks, sizes, runs)
        return CallCost(collective, group, *fit_call_cost(sizes, seconds))
    except ValueError:
        seconds = _time_calls(collective, group, ranks, sizes, 3 * runs)
        try:
            return CallCost(collective, group, *fit_call_cost(sizes, seconds))
        except ValueError as exc:
            raise ValueError(f"gloo {collective} on groups of {group} among {ranks} ranks: {exc}") from exc


def _operation(collective: str, group: Any, nbytes: int, size: int) -> Callable[[], None]:
    """One call of ``collective`` moving ``nbytes`` on the gloo ``group`` of ``size`` endpoints."""
    import torch

    elements = max(size, nbytes // 4 // size * size)
    whole = torch.ones(elements)
    slot = elements // size
    if collective == "all_reduce":
        return lambda: group.allreduce([whole]).wait()
    if collective == "all_gather":
        outputs = [list(whole.split(slot))]
        mine = torch.ones(slot)
        return lambda: group.allgather(outputs, [mine]).wait()
    if collective == "reduce_scatter":
        inputs = [list(whole.split(slot))]
        mine = torch.empty(slot)
        return lambda: group.reduce_scatter([mine], inputs).wait()
    if collective == "all_to_all":
        received = torch.empty(elements)
        return lambda: group.alltoall_base(received, whole, [], []).wait()
    raise ValueError(f"no measurement for {collective!r}; choose one of {', '.join(COLLECTIVES)}")


def _time_calls(collective: str, group: int, ranks: int, sizes: tuple[int, ...], runs: int) -> list[float]:
    """Median seconds per size of ``collective`` on groups of ``group`` while ``ranks`` threads run
    ``ranks / group`` such groups at once; the slowest endpoint's median, as a step waits for it."""
    import torch.distributed as dist

    medians: dict[int, list[float]] = {n: [] for n in sizes}
    failures: list[BaseException] = []
    with tempfile.TemporaryDirectory(prefix="meshwise-calls-") as scratch:

        def endpoint(rank: int) -> None:
            try:
                store = dist.FileStore(str(Path(scratch) / f"store{rank // group}"), group)
                pg = dist.ProcessGroupGloo(store, rank % group, group, datetime.timedelta(seconds=30))
                for n in sizes:
                    call = _operation(collective, pg, n, group)
                    call()  # connect and warm up
                    times = []
                    for _ in range(runs):
                        started = time.perf_counter()
                        call()
                        times.append(time.perf_counter() - started)
                    medians[n].append(statistics.median(times))
            except BaseException as exc:  # reported below, with the collective's name
                failures.append(exc)

        threads = [threading.Thread(target=endpoint, args=(r,), daemon=True) for r in range(ranks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        if failures or any(t.is_alive() for t in threads):
            reason = repr(failures[0]) if failures else "did not finish in 60 s"
            raise RuntimeError(f"timing gloo {collective} on groups of {group} among {ranks} ranks: {reason}")
    return [max(medians[n]) for n in sizes]
