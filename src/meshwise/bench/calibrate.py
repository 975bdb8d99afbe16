"""``meshwise bench --calibrate``: measure the cost model's link parameters and write its file.

Three links are fitted (see :mod:`meshwise.comm.cost`), each from a sweep whose samples the model can
express as a·α + b·β + c·γ + s·σ + d·δ:

* ``native`` — the backend's own all_reduce, all_gather and reduce_scatter over all ranks (all rings, so
  σ and δ cannot be told from α and β there and stay zero: the native shape needs only its own sum);
* ``intra``  — our ring all_reduce, ring all_gather, recursive-doubling all_reduce and tree all_reduce
  among the ranks of one node (all_gather has no γ term, recursive doubling a different α/β ratio, and
  the tree's one-way steps separate the exchange-step terms σ, δ from α, β);
* ``inter``  — the same plan among one rank per node, measured only when the job spans several nodes.

A job over several nodes holding the same number of ranks each also measures the *levels* of the
two-level communicator (``backend="auto"`` there, :mod:`meshwise.comm.two_level`), each on its own
transport's collectives — the ones the two-level communicator runs on it (``LEVEL_PLANS``): ``intra`` on
shared memory among the ranks of a node, ``inter`` on gloo among the ranks at one local position of every
node *with every local position measuring at once* (each round starts at one barrier over the whole job
and lasts until the slowest group is done: the hierarchical collectives' traffic pattern, so a network
the ranks of a node share is priced as shared: β per rank L times the link's own), and ``flat`` on gloo
over the whole job (its ring's node-crossing hops share the network as they do in the call). Calls are
timed back to back, and the two network links may be token buckets (``burst``, see
:class:`~meshwise.comm.cost.formulas.LinkParams`). The outcome names the transport of each.

A class that cannot be measured in this job (one node → no ``inter``; one rank per node → no ``intra``)
keeps its value from the existing file, or the built-in default, and the outcome says so. The fit is
:func:`~meshwise.comm.cost.fit.fit_link_params` (non-negative least squares on relative error). Its *worst
factor* — the largest of predicted/measured and measured/predicted over the samples, 1.0 for a perfect
fit, and the only meaning the words have in meshwise's output — is reported, and a warning is printed
above :data:`POOR_FIT_FACTOR`, since a poor fit means the model's predictions (and ``auto``) are off too.
The fit is stored for this job's world size in the file's ``by_world_size`` and merged with the entries
already there (other world sizes are kept; the top-level links become this fit), because α depends on how
many ranks share the cores: running ``-np 2`` and then ``-np 4`` leaves a calibration for both.
Each sample is the fastest iteration of its size (the per-iteration maximum over ranks, minimised over
iterations): α, β and γ describe what the link and the cores can do, and on a shared machine the mean is
dominated by whichever other job happened to run; the benchmark tables keep reporting means.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from meshwise.bench.live import EventProgress
from meshwise.bench.runner import RunResult, SweepConfig, run_sweep
from meshwise.comm.algorithms import with_algorithm
from meshwise.comm.algorithms.hierarchical import Hierarchy, member_split
from meshwise.comm.api import Communicator, ReduceOp
from meshwise.comm.cost import DEFAULT_FILE, Calibration, CostSample, Levels, LinkParams, WorldLinks
from meshwise.comm.cost.fit import fit_link_params
from meshwise.comm.cost.formulas import hierarchical_seconds
from meshwise.comm.native import NativeCommunicator
from meshwise.comm.topology import Topology
from meshwise.comm.two_level import build_hierarchy

NATIVE_PLAN = (("all_reduce", "native"), ("all_gather", "native"), ("reduce_scatter", "native"))
LINK_PLAN = (("all_reduce", "ring"), ("all_gather", "ring"), ("all_reduce", "rd"), ("all_reduce", "tree"))
#: A fit whose worst factor exceeds this has some size off by more than 2×: warned about.
POOR_FIT_FACTOR = 2.0


@dataclass(frozen=True)
class LinkFit:
    """The fitted parameters of one link class, or why it was not measured."""

    name: str
    params: LinkParams
    worst_factor: float | None  # max of predicted/measured and measured/predicted (1.0 = exact); None: kept
    samples: int
    note: str = ""


@dataclass(frozen=True)
class CalibrationOutcome:
    path: str
    links: tuple[LinkFit, ...]
    runs: tuple[RunResult, ...]
    world_size: int  # the entry this run wrote
    world_sizes: tuple[int, ...]  # every world size the file now holds an entry for
    #: the two-level links (intra, inter, flat), each named after its transport; empty on one node
    levels: tuple[LinkFit, ...] = ()
    switch: float = 0.0  # the two-level hand-over time (Levels.switch), with the levels


def _sweep(
    comm: Communicator,
    control: Communicator,
    plan: tuple[tuple[str, str], ...],
    sweep: SweepConfig,
    device: torch.device,
    progress: EventProgress | None,
    label: str,
) -> list[RunResult]:
    runs = []
    for collective, algo in plan:
        config = replace(sweep, collective=collective, op="sum", checks=0, corrupt_rank=None)
        task = (
            progress.add_task(f"calibrate {label}: {collective}/{algo}", total=len(config.sizes))
            if (progress is not None)
            else None
        )
        rows = run_sweep(
            with_algorithm(comm, algo),
            control,
            config,
            device,
            on_size=None if task is None else lambda _, t=task: progress.advance(t),
        )
        runs.append(RunResult(collective, comm.backend, algo, comm.world_size, tuple(rows)))
    return runs


def _fit(name: str, runs: list[RunResult]) -> LinkFit:
    samples = [
        CostSample(run.collective, run.algorithm, row.size, run.world_size, row.fastest_us * 1e-6)
        for run in runs
        for row in run.rows
        if row.count > 0
    ]
    params, excess = fit_link_params(samples)  # the worst factor minus one
    return LinkFit(name, params, 1.0 + excess, len(samples))


def _kept(name: str, params: LinkParams, why: str, source: str) -> LinkFit:
    return LinkFit(name, params, None, 0, f"not measured ({why}); kept the {source}")


def calibrate(
    base: Communicator,
    control: Communicator,
    nodes: list[int],
    sweep: SweepConfig,
    device: torch.device,
    path: str | None,
    progress: EventProgress | None,
) -> CalibrationOutcome | None:
    """Run the calibration sweeps on every rank; rank 0 fits, saves and returns the outcome."""
    file = calibration_target(path)
    previous = previous_calibration(file)
    known = previous.for_world(base.world_size)  # what a link this job cannot measure keeps
    source = f"value from {file}" if file.exists() else "built-in default"
    node_ids = sorted(set(nodes))
    members = {node: [r for r, n in enumerate(nodes) if n == node] for node in node_ids}
    measured = _calibrate_levels(control, Topology(tuple(nodes)), sweep, device, progress)
    native_runs = _sweep(base, control, NATIVE_PLAN, sweep, device, progress, "native")
    runs = list(native_runs)
    fits = {"native": _fit("native", native_runs)} if base.world_size > 1 else {}

    if len(node_ids) == 1:
        local, local_control = base, control
    else:
        local = member_split(base, [members[n] for n in node_ids])
        local_control = member_split(control, [members[n] for n in node_ids])
    if local.world_size > 1:
        intra_runs = _sweep(local, local_control, LINK_PLAN, sweep, device, progress, "intra")
        runs += intra_runs
        fits["intra"] = _fit("intra", intra_runs)
    if local is not base:
        local.close()
        local_control.close()

    if len(node_ids) > 1:
        leaders = [members[n][0] for n in node_ids]
        # every other rank gets a group of its own: each rank joins exactly one group of the partition
        # (see hierarchical.member_split for why that matters)
        partition = [leaders, *([r] for r in range(base.world_size) if r not in leaders)]
        across = member_split(base, partition)
        across_control = member_split(control, partition)
        if base.rank in leaders:
            inter_runs = _sweep(across, across_control, LINK_PLAN, sweep, device, progress, "inter")
            runs += inter_runs
            fits["inter"] = _fit("inter", inter_runs)
        across.close()
        across_control.close()
        control.barrier()  # the other ranks wait here while the leaders measure
    if base.rank != 0:
        return None
    links = (
        fits.get("intra") or _kept("intra", known.intra, "one rank per node", source),
        fits.get("inter") or _kept("inter", known.inter, "the job runs on one node", source),
        fits.get("native") or _kept("native", known.native, "a single rank", source),
    )
    merged = merge_fit(previous, base.world_size, *(fit.params for fit in links))
    if measured is not None:
        merged = merged.with_levels(measured.levels)
    saved = merged.save(file)
    sizes = tuple(p for p, _ in merged.by_world_size)
    level_fits, switch = (measured.fits, measured.switch) if measured is not None else ((), 0.0)
    return CalibrationOutcome(str(saved), links, tuple(runs), base.world_size, sizes, level_fits, switch)


def _calibrate_levels(
    control: Communicator,
    topology: Topology,
    sweep: SweepConfig,
    device: torch.device,
    progress: EventProgress | None,
) -> MeasuredLevels | None:
    """The two-level communicator's links, fitted (every rank calls it; None where the job has one
    node, nodes of one rank, or nodes holding different numbers of ranks)."""
    if topology.nodes < 2 or not topology.uniform or topology.local_size < 2 or device.type != "cpu":
        return None
    flat = NativeCommunicator(None, timeout=control.timeout)
    hierarchy = build_hierarchy(flat, topology, "shm")
    assert hierarchy is not None  # uniform nodes
    try:
        return measure_levels(hierarchy, flat, control, sweep, device, progress)
    finally:
        hierarchy.close()


#: What each two-level link is measured on: the collectives the two-level communicator runs on it (the
#: hierarchical all_reduce reduce-scatters and all-gathers inside a node and all-reduces across; the flat
#: and the inter-node transports also all-gather). Not gloo's reduce_scatter: gloo runs it as an
#: all_reduce of the whole buffer (measured: as long as the all_reduce of the same bytes on both gloo
#: links), so pricing it as a ring reduce-scatter would halve the fitted β.
LEVEL_PLANS = {
    "intra": ("reduce_scatter", "all_gather"),
    "inter": ("all_reduce", "all_gather"),
    "flat": ("all_reduce", "all_gather"),
}
#: Back-to-back rounds per size in a level's calibration; the median round is the sample.
LEVEL_ROUNDS = 5
#: The hand-over between the levels is measured on the hierarchical all_reduce at this many of the
#: calibration's smallest sizes, where the levels' latencies dominate and their β terms barely count.
SWITCH_SIZES = 3


@dataclass(frozen=True)
class MeasuredLevels:
    """The two-level links' fits and the hand-over time between the levels."""

    fits: tuple[LinkFit, ...]
    switch: float

    @property
    def levels(self) -> Levels:
        return Levels(*(fit.params for fit in self.fits), switch=self.switch)


def measure_levels(
    hierarchy: Hierarchy,
    flat: Communicator,
    control: Communicator,
    sweep: SweepConfig,
    device: torch.device,
    progress: EventProgress | None = None,
) -> MeasuredLevels:
    """Fit the intra, inter and flat links of an existing two-level layout (every rank calls it); each
    fit is named after its transport. Then the hand-over time (:attr:`Levels.switch`): the hierarchical
    all_reduce at the :data:`SWITCH_SIZES` smallest sizes, the median of its time minus the fitted
    levels' price, per hand-over (two), and never negative. Every group of a level runs at once, started
    together by ``control``'s barrier (the nodes' intra groups side by side, every local position across nodes
    sharing the network), as in the hierarchical collectives; no further groups are split. The links
    that cross the network (inter, flat) may be token buckets (:attr:`LinkParams.burst`)."""
    fits = []
    for name, comm in (("intra", hierarchy.intra), ("inter", hierarchy.inter), ("flat", flat)):
        label = f"{name}-node {comm.backend}" if name != "flat" else f"flat {comm.backend}"
        samples = _concurrent_samples(comm, control, LEVEL_PLANS[name], sweep, device)
        params, excess = fit_link_params(samples, burst=name != "intra")
        fits.append(LinkFit(label, params, 1.0 + excess, len(samples)))
        if progress is not None:
            progress.advance(progress.add_task(f"calibrate {label}", total=1))
    p, local = flat.world_size, hierarchy.local_size
    beyond = []
    for nbytes in sorted(sweep.sizes)[:SWITCH_SIZES]:
        data = torch.ones(max(1, nbytes // (4 * p)) * p, device=device)
        measured = _round_seconds(partial(hierarchy.all_reduce, data, ReduceOp.SUM), control, sweep)
        levels_alone = hierarchical_seconds(
            "all_reduce", data.numel() * 4, p, local, fits[0].params, fits[1].params
        )
        beyond.append(measured - levels_alone)
    control.barrier()
    return MeasuredLevels(tuple(fits), max(0.0, statistics.median(beyond)) / 2)


def _concurrent_samples(
    comm: Communicator,
    control: Communicator,
    plan: tuple[str, ...],
    sweep: SweepConfig,
    device: torch.device,
) -> list[CostSample]:
    """One sample per collective of ``plan`` on ``comm`` and size: the median of :data:`LEVEL_ROUNDS`
    rounds, each started by a barrier of ``control`` (a group spanning all of ``comm``'s sibling groups,
    which run at once) and timing ``sweep.iters`` calls back to back, per call, averaged over the ranks
    (the statistic the benchmarks report: a single rank's time is off by when it left the barrier).
    The median rather than the fastest round: the latency-bound sizes of a composed collective pay the
    machine's typical scheduling delay at every phase, and a fastest round (a quiet moment on a shared
    machine) priced them at about half what the sweeps then measured; one disturbed round does not move
    a median.

    Back to back as the benchmarks and a training loop issue them: a token-bucket link's credit is spent
    in the warm-up and each call gets only what the link refills while the call itself idles it — a
    barrier before every call would refill it and price mid-sized messages at the wire's speed."""
    p = comm.world_size
    samples = []
    for collective in plan:
        for nbytes in sweep.sizes:
            count = max(1, nbytes // (4 * p)) * p  # float32 elements, a multiple of the group size
            whole = torch.ones(count, device=device)
            part = torch.ones(count // p, device=device)

            seconds = _round_seconds(partial(_call, comm, collective, whole, part), control, sweep)
            samples.append(CostSample(collective, "native", count * 4, p, seconds))
    return samples


def _round_seconds(call: Callable[[], None], control: Communicator, sweep: SweepConfig) -> float:
    """``call``'s time: warmed up, then the median of :data:`LEVEL_ROUNDS` rounds of ``sweep.iters``
    calls back to back after a barrier of ``control``, per call, averaged over ``control``'s ranks."""
    for _ in range(sweep.warmup):
        call()
    rounds = torch.zeros(LEVEL_ROUNDS, dtype=torch.float64)
    for r in range(LEVEL_ROUNDS):
        control.barrier()
        start = time.perf_counter()
        for _ in range(sweep.iters):
            call()
        rounds[r] = (time.perf_counter() - start) / sweep.iters
    control.all_reduce(rounds, "sum")  # the average over every rank of the job (nccl-tests)
    rounds /= control.world_size
    return float(rounds.median())


def _call(comm: Communicator, collective: str, whole: torch.Tensor, part: torch.Tensor) -> None:
    """One call of ``collective`` over ``whole`` (every rank's ``part`` its slot)."""
    if collective == "all_reduce":
        comm.all_reduce(whole)
    elif collective == "all_gather":
        comm.all_gather(whole, part)
    else:
        comm.reduce_scatter(part, whole)


def merge_fit(
    previous: Calibration, world_size: int, intra: LinkParams, inter: LinkParams, native: LinkParams
) -> Calibration:
    """``previous`` with this job's fit as the top-level links and as the entry for ``world_size``; the
    entries of other world sizes and the two-level links stay, so successive runs accumulate."""
    latest = replace(previous, intra=intra, inter=inter, native=native)
    return latest.with_world(world_size, WorldLinks(intra, native))


def calibration_target(path: str | None) -> Path:
    """The file ``--calibrate`` writes: ``path``, or :data:`~meshwise.comm.cost.DEFAULT_FILE`."""
    return Path(path).expanduser() if path is not None else DEFAULT_FILE.expanduser()


def previous_calibration(file: Path) -> Calibration:
    """What a new fit is merged into: the target file when it exists, else the built-in calibration
    (raises ValueError on a malformed file, so ``meshwise bench`` can refuse it before launching)."""
    return Calibration.load(file) if file.exists() else Calibration.builtin()


def format_outcome(outcome: CalibrationOutcome) -> str:
    """α and σ in µs, β, γ and δ as the bandwidths they stand for (GB/s), and the fit error per link."""
    held = ", ".join(str(p) for p in outcome.world_sizes)
    lines = [
        f"# Calibration written to {outcome.path}",
        f"# for world size {outcome.world_size}; the file has entries for world sizes {held}",
    ]
    lines.append(
        f"# {'link':<7} {'alpha(us)':>10} {'1/beta(GB/s)':>13} {'1/gamma(GB/s)':>14} {'sigma(us)':>10} "
        f"{'1/delta(GB/s)':>14} {'worst factor':>12}"
    )
    lines.extend(_link_line(fit) for fit in outcome.links)
    if outcome.levels:
        lines.append("# two-level links (backend auto over several nodes), each named after its transport:")
        lines.extend(_link_line(fit, width=14) for fit in outcome.levels)
        lines.append(f"# hand-over between the levels: {outcome.switch * 1e6:.1f} us (twice per all_reduce)")
    lines.append(f"# auto prices with it when named: --calibration-file {outcome.path}")
    for fit in (*outcome.links, *outcome.levels):
        if fit.worst_factor is not None and fit.worst_factor > POOR_FIT_FACTOR:
            lines.append(
                f"# warning: the {fit.name} fit is poor: some size is off by {fit.worst_factor:.2f}x; the "
                "model's predictions and auto's choices cannot be trusted that far here (a busy machine? "
                "rerun with more iterations, -n, or when it is quiet)"
            )
    return "\n".join(lines)


def _link_line(fit: LinkFit, width: int = 7) -> str:
    """One link's row of the outcome table."""
    p = fit.params
    error = f"{fit.worst_factor:.2f}x" if fit.worst_factor is not None else "-"
    line = (
        f"# {fit.name:<{width}} {p.alpha * 1e6:>10.2f} {_bandwidth(p.beta):>13} {_bandwidth(p.gamma):>14} "
        f"{p.sigma * 1e6:>10.2f} {_bandwidth(p.delta):>14} {error:>12}"
    )
    if p.burst > 0:
        line += f"  burst {p.burst / 1024:.0f} KiB"
    if fit.note:
        return line + f"  {fit.note}"
    return line + (f"  ({fit.samples} samples)" if fit.samples else "")


def _bandwidth(seconds_per_byte: float) -> str:
    """GB/s that a per-byte cost stands for ("inf" when the fit left it at zero)."""
    return f"{1e-9 / seconds_per_byte:.3f}" if seconds_per_byte > 0 else "inf"
