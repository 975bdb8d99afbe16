"""What every rank of ``meshwise bench`` runs: join the job, build each backend/algorithm, sweep.

torch.distributed on gloo (CPU) is the control plane: it carries the barriers and the reductions of
times and error counts. The communicator under test is built per backend with
:func:`~meshwise.comm.factory.create_communicator` (nccl gets its own CUDA process group) and wrapped
with :func:`~meshwise.comm.algorithms.with_algorithm` per algorithm. An algorithm that does not implement
a collective would only rerun the backend's own operation, so that pair is skipped with a note rather
than reported twice under two names. ``auto`` prices with rank 0's calibration, sent to every rank, so
that all ranks choose the same algorithm even when their nodes hold different calibration files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from meshwise.bench.calibrate import CalibrationOutcome, calibrate
from meshwise.bench.live import EventProgress, Sink, emitter
from meshwise.bench.runner import RunResult, SweepConfig, run_sweep, sweep_length
from meshwise.comm.algorithms import registry, with_algorithm
from meshwise.comm.api import Communicator
from meshwise.comm.cost import PARAMETERS, Calibration, Levels, LinkParams
from meshwise.comm.cost.calibration import source_of
from meshwise.comm.factory import create_communicator
from meshwise.runtime.timeouts import DEFAULT_TIMEOUT_S
from meshwise.world import World, init, shutdown


@dataclass(frozen=True)
class BenchJob:
    """Everything a rank needs, validated by the CLI before any rank starts."""

    collectives: tuple[str, ...]
    backends: tuple[str, ...]
    algorithms: tuple[str, ...]
    sweep: SweepConfig  # its collective is replaced per run
    timeout: float = DEFAULT_TIMEOUT_S  # each wait of the communicators under test
    calibrate: bool = False
    calibration_file: str | None = None  # what --calibrate writes (None: the default file)
    pricing_file: str | None = None  # the calibration auto prices with (None: the built-in one)


@dataclass(frozen=True)
class JobResult:
    """Rank 0's view of the whole job."""

    launcher: str
    world_size: int
    runs: tuple[RunResult, ...]
    notes: tuple[str, ...]
    calibration: CalibrationOutcome | None


def covers(algorithm: str, collective: str) -> bool:
    """True when ``algorithm`` runs ``collective`` itself (native and auto cover everything)."""
    return algorithm in ("native", "auto") or registry.covers(algorithm, collective)


def node_map(world: World, control: Communicator) -> list[int]:
    """The node id of every rank (all ranks call it)."""
    nodes = torch.empty(world.world_size, dtype=torch.int64)
    control.all_gather(nodes, torch.tensor([world.node_rank], dtype=torch.int64))
    return nodes.tolist()


def shared_calibration(control: Communicator, path: str | None) -> Calibration:
    """Rank 0's calibration (the file ``path``, or the built-in one when None) for this job's world size,
    on every rank (all ranks call it): the entry measured at this world size, or the nearest one
    (``Calibration.for_world``)."""
    names = (*PARAMETERS, "burst")
    width = len(names)
    # + the levels' hand-over time, and whether the file holds two-level links
    values = torch.zeros(6 * width + 2, dtype=torch.float64)
    if control.rank == 0:
        cal = Calibration.from_option(path).for_world(control.world_size)
        levels = cal.two_level()  # the two-level communicator's links (shm+gloo)
        links = (cal.intra, cal.inter, cal.native, levels.intra, levels.inter, levels.native)
        numbers = [getattr(link, name) for link in links for name in names]
        extra = [cal.level_switch(), float(cal.levels is not None)]
        values = torch.tensor([*numbers, *extra], dtype=torch.float64)
    control.broadcast(values, 0)
    *numbers, switch, measured = values.tolist()
    intra, inter, native, *level_links = (
        LinkParams(**dict(zip(names, numbers[i : i + width], strict=True)))
        for i in range(0, 6 * width, width)
    )
    levels = Levels(*level_links, switch=switch) if measured else None
    return Calibration(intra, inter, native, source=source_of(path), levels=levels)


def data_communicator(
    backend: str, world: World, timeout: float, calibration: Calibration
) -> tuple[Communicator, torch.device]:
    """The communicator under test for ``backend`` and the device its tensors live on (``shm+gloo``
    chooses flat or hierarchical per call with ``calibration``'s two-level links)."""
    if backend == "nccl":
        device = torch.device("cuda", world.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        group = dist.new_group(backend="nccl")
        return create_communicator("nccl", group, timeout=timeout), device
    options = {"calibration": calibration} if backend == "shm+gloo" else {}
    return create_communicator(backend, timeout=timeout, **options), torch.device("cpu")


def bench_rank_main(job: BenchJob, sink: Sink | None = None) -> JobResult | None:
    """Run the job on this rank; rank 0 returns the result, the others None. Rank 0 also reports each
    run, row and progress step to ``sink`` as it happens (see :mod:`meshwise.bench.live`)."""
    world = init("gloo", device="cpu", timeout=job.timeout)
    try:
        return _run(job, world, emitter(sink) if sink is not None and world.rank == 0 else None)
    finally:
        shutdown()


def _run(job: BenchJob, world: World, emit: Callable[[tuple], None] | None) -> JobResult | None:
    control = world.comm
    nodes = node_map(world, control)
    runs: list[RunResult] = []
    notes: list[str] = []
    skipped: dict[str, list[str]] = {}  # algorithm -> collectives it does not implement
    outcome = None
    main = world.rank == 0
    calibration = shared_calibration(control, job.pricing_file)
    progress = EventProgress(emit) if emit is not None else None
    for backend in job.backends:
        base, device = data_communicator(backend, world, job.timeout, calibration)
        for algorithm in job.algorithms:
            comm = with_algorithm(base, algorithm, node_map=nodes, calibration=calibration)
            for collective in job.collectives:
                if collective == "sendrecv" and world.world_size < 2:
                    notes.append("sendrecv: skipped, it needs at least 2 ranks")
                    continue
                if not covers(algorithm, collective):
                    if collective not in skipped.setdefault(algorithm, []):
                        skipped[algorithm].append(collective)
                    continue
                config = replace(job.sweep, collective=collective)
                task = None
                if progress is not None and emit is not None:
                    task = progress.add_task(
                        f"{collective} {backend}/{algorithm}", sweep_length(config, world.world_size)
                    )
                    emit(("run", collective, backend, algorithm, world.world_size))
                rows = run_sweep(
                    comm,
                    control,
                    config,
                    device,
                    on_size=None if task is None else lambda _, t=task: progress.advance(t),
                    on_row=None if emit is None else lambda row: emit(("row", row)),
                )
                if emit is not None:
                    emit(("end",))
                runs.append(RunResult(collective, backend, algorithm, world.world_size, tuple(rows)))
            if comm is not base:
                comm.close()  # the node groups hierarchical/auto split off
        if job.calibrate and backend == job.backends[0]:
            outcome = calibrate(base, control, nodes, job.sweep, device, job.calibration_file, progress)
        base.close()
    if not main:
        return None
    for algorithm, collectives in skipped.items():
        notes.append(
            f"{algorithm}: skipped {', '.join(collectives)}; it implements only "
            f"{', '.join(registry.implemented(algorithm))}, and the others would run the backend's own "
            "operation"
        )
    return JobResult(world.launcher, world.world_size, tuple(runs), tuple(dict.fromkeys(notes)), outcome)
