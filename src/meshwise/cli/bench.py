"""``meshwise bench COLLECTIVE``: collective benchmarks with nccl-tests' columns, checks, JSON and plots.

With ``-np N`` it starts N local ranks itself (default 2); under a launcher (``meshwise run``, torchrun,
srun, mpirun) it runs on the ranks it was started on and rank 0 prints. Every option is checked before
any rank starts. The exit code is 0 when every check passed, 1 when a value was wrong or written out of
bounds (or a rank failed), 2 for bad options.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import sys
import time
from dataclasses import replace

import torch

from meshwise.bench.busbw import COLLECTIVES, REDUCING, layout_for
from meshwise.bench.calibrate import calibration_target, format_outcome, previous_calibration
from meshwise.bench.cases import buffer_bytes
from meshwise.bench.job import BenchJob, JobResult, bench_rank_main, covers
from meshwise.bench.jsonio import BenchRecord, write_json
from meshwise.bench.live import LiveReport, Sink, emitter, pump
from meshwise.bench.report import output_console, print_runs
from meshwise.bench.runner import (
    ALL_ROOTS,
    AVERAGES,
    DTYPE_ALIASES,
    DTYPES,
    TIMINGS,
    RunResult,
    SweepConfig,
    default_average,
    describe_timing,
)
from meshwise.bench.sizes import parse_size, size_sweep
from meshwise.cli import summary
from meshwise.cli.outputs import check_output, check_plot, write_outputs
from meshwise.comm.algorithms.registry import ALGORITHMS, ALIASES, canonical_algorithm, reference_table
from meshwise.comm.api import CommError, ReduceOp
from meshwise.comm.cost import DEFAULT_FILE, Calibration
from meshwise.comm.cost.calibration import source_of
from meshwise.comm.factory import BACKENDS, check_backend
from meshwise.runtime.env import check_mpi_launch, detect_launch_env, plan_ranks
from meshwise.runtime.memory import (
    NCCL_RESERVE,
    check_device_memory,
    check_memory,
    free_device_memory,
)
from meshwise.runtime.on_ranks import run_on_ranks
from meshwise.runtime.spawn import SpawnError
from meshwise.runtime.timeouts import wait_timeout

#: nccl-tests' -i default, used when -f 1 asks for stepping without giving -i.
DEFAULT_STEP_BYTES = 1 << 20
_DRAIN_SECONDS = 5.0  # the last events are read after the ranks exit: bounded, never a hang


def _split(text: str, option: str) -> tuple[str, ...]:
    """The names of a comma list, each once, in order."""
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if not names:
        raise ValueError(f"{option} {text!r} names nothing; pass a comma list")
    return names


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(
        name,
        help=help_text,
        description=summary(__doc__),
        epilog=f"algorithms (--algo):\n{reference_table()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "collective",
        nargs="?",
        choices=(*COLLECTIVES, "all"),
        metavar="COLLECTIVE",
        help=f"one of {', '.join(COLLECTIVES)}, or all (optional with --calibrate)",
    )
    parser.add_argument("-np", "--nproc", dest="np", type=int, default=None, help="local ranks (default 2)")
    parser.add_argument("-b", "--minbytes", default="8", help="smallest size, e.g. 8, 4K (default 8)")
    parser.add_argument("-e", "--maxbytes", default="64M", help="largest size, e.g. 64M, 1G (default 64M)")
    parser.add_argument(
        "-f", "--stepfactor", type=int, default=None, help="multiply the size by F (default 2; 1: add -i)"
    )
    parser.add_argument("-i", "--stepbytes", default=None, help="add this many bytes instead, e.g. 1M")
    parser.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size (default 20)")
    parser.add_argument("-w", "--warmup", type=int, default=5, help="untimed iterations per size (default 5)")
    parser.add_argument(
        "-a",
        "--average",
        type=int,
        choices=sorted(AVERAGES),
        default=None,
        help="combine the ranks' times as nccl-tests: 0 rank 0, 1 average, 2 min, 3 max "
        "(default 1; 3 with --timing barrier)",
    )
    parser.add_argument(
        "--timing",
        choices=TIMINGS,
        default="loop",
        help="loop: -n iterations back to back, divided (nccl-tests); barrier: a barrier before each "
        "iteration, timed alone (default loop)",
    )
    parser.add_argument(
        "--skew",
        type=int,
        default=1,
        metavar="K",
        help="all_to_all: rank 0 is a hot spot exchanging K slots with every other rank, both ways, "
        "through all_to_all_single's split sizes (default 1: nccl-tests' even alltoall)",
    )
    parser.add_argument("-c", "--check", type=int, default=1, help="check results K times per size (0: off)")
    parser.add_argument(
        "-d", "--dtype", choices=(*DTYPES, *DTYPE_ALIASES), default="float32", help="element type (float32)"
    )
    parser.add_argument(
        "-o", "--op", choices=[o.value for o in ReduceOp], default="sum", help="reduction op (sum)"
    )
    parser.add_argument(
        "-r", "--root", type=int, default=0, help="root of broadcast/reduce/gather/scatter; -1: every root"
    )
    parser.add_argument(
        "--backend", default=None, help="comma list of gloo,nccl,shm,mpi,shm+gloo (default nccl on GPUs)"
    )
    parser.add_argument(
        "--algo",
        default="native",
        help=f"comma list of {','.join(ALGORITHMS)} (also {','.join(ALIASES)}); see the table below",
    )
    parser.add_argument("--json", metavar="FILE", help="write every row and the machine to FILE")
    parser.add_argument("--plot", metavar="FILE", help="draw busbw vs size to FILE (PNG)")
    parser.add_argument("--ceiling", type=float, metavar="GBPS", help="link bandwidth to draw on the plot")
    parser.add_argument(
        "--calibrate", action="store_true", help="fit the cost model (α, β, γ, σ, δ) and write its file"
    )
    parser.add_argument(
        "--calibration-file",
        metavar="PATH",
        help="cost-model file that auto and the plot's model lines use (default: the built-in "
        f"calibration); --calibrate writes it (default {DEFAULT_FILE})",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="deadline for the whole run, seconds")
    # Test hook (docs/bench.md): this rank corrupts one element of its result before each check.
    parser.add_argument("--inject-error", type=int, metavar="RANK", default=None, help=argparse.SUPPRESS)
    parser.set_defaults(func=handler)


def _world_size(args: argparse.Namespace) -> tuple[int, str, int, list[int]]:
    """World size, launcher, how many ranks share this machine's memory, and the local ranks whose GPU
    this process checks: every rank it will spawn or, started by a launcher, its own (each peer checks
    its own GPU; asking creates a CUDA context on the device asked about)."""
    plan = plan_ranks(args.np, default=2)
    if plan.launched:
        layout = plan.layout
        return plan.world_size, layout.launcher, layout.local_world_size, [layout.local_rank]
    return plan.world_size, "local", plan.world_size, list(range(plan.world_size))


def _check_memory(
    collectives: tuple[str, ...],
    largest: int,
    world_size: int,
    local: tuple[int, list[int]],
    backends: tuple[str, ...],
    args: argparse.Namespace,
) -> None:
    """Refuse a sweep whose largest size cannot fit: per rank, the buffers the check-and-time case
    allocates. On CPU backends add one working copy of S for the transport (gloo's and our algorithms'
    temporaries), times the ranks on this machine (``local[0]``), against its available memory; with
    nccl the buffers live on the GPUs (cuda:local_rank of the ranks in ``local[1]``), each checked for
    them plus NCCL's own."""
    itemsize = DTYPES[DTYPE_ALIASES.get(args.dtype, args.dtype)].itemsize
    root = max(args.root, 0)  # -r -1 visits every root; any of them holds the most
    buffers = working = 0
    for collective in collectives or ("all_reduce",):  # --calibrate alone sweeps all_reduce-sized buffers
        layout = layout_for(collective, largest, world_size, itemsize)
        case = buffer_bytes(layout, rank=root, root=root)
        buffers, working = max(buffers, case), max(working, case + layout.nbytes)
    ranks, gpu_ranks = local
    what = f"-e {args.maxbytes} on {ranks} rank{'s' if ranks > 1 else ''}"
    if set(backends) - {"nccl"}:
        check_memory(working * ranks, what, "lower -e (or -np)")
    if "nccl" in backends:
        count = torch.cuda.device_count()
        free = free_device_memory(sorted({rank % count for rank in gpu_ranks}))
        check_device_memory(buffers + NCCL_RESERVE, free, what, "lower -e")


def _check_backends(backends: tuple[str, ...]) -> None:
    for backend in backends:
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError(
                "backend nccl needs CUDA GPUs, and none is visible here; use --backend gloo or shm"
            )
        if backend == "mpi":
            check_mpi_launch("bench all_reduce")
        module = BACKENDS[backend].split(":")[0]
        if importlib.util.find_spec(module) is None:
            raise ValueError(f"backend {backend} is not available in this installation ({module} is missing)")


def _stepping(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """(factor, step) of the sweep. As in nccl-tests, ``-f 1`` means "no factor: add -i bytes" (1M when
    -i is not given); a factor of 2 or more and -i together are ambiguous."""
    if args.stepbytes is None:
        if args.stepfactor == 1:
            return None, DEFAULT_STEP_BYTES
        return (args.stepfactor if args.stepfactor is not None else 2), None
    if args.stepfactor not in (None, 1):
        raise ValueError(f"-f {args.stepfactor} and -i {args.stepbytes} conflict: give -f 1 or leave -f out")
    return None, parse_size(args.stepbytes)


def _check_coverage(collective: str, algorithms: tuple[str, ...]) -> None:
    """A named collective must be implemented by every named algorithm: the backend's own operation
    reported under the algorithm's name would be a wrong answer (``all`` skips such pairs instead)."""
    lacking = [a for a in algorithms if not covers(a, collective)]
    if lacking:
        able = [a for a in ALGORITHMS if covers(a, collective)]
        raise ValueError(
            f"--algo {','.join(lacking)} does not implement {collective}; choose from {', '.join(able)}"
        )


def build_job(args: argparse.Namespace) -> tuple[BenchJob, int, str]:
    """The validated job, its world size and launcher; ValueError says which option to change."""
    if args.collective is None and not args.calibrate:
        raise ValueError("name a COLLECTIVE (or all), or pass --calibrate")
    world_size, launcher, local_ranks, gpu_ranks = _world_size(args)
    collectives = (
        () if args.collective is None else COLLECTIVES if args.collective == "all" else (args.collective,)
    )
    if args.collective == "sendrecv" and world_size < 2:
        raise ValueError("sendrecv needs at least 2 ranks (each rank sends to the next); use -np 2")
    if args.calibrate and world_size < 2:
        raise ValueError("--calibrate measures links between ranks: use at least -np 2")
    factor, step = _stepping(args)
    sizes = size_sweep(parse_size(args.minbytes), parse_size(args.maxbytes), factor=factor, step=step)
    dtype = DTYPE_ALIASES.get(args.dtype, args.dtype)
    if args.iters < 1 or args.warmup < 0 or args.check < 0:
        raise ValueError("-n must be at least 1, and -w and -c at least 0")
    if args.op == "avg" and not DTYPES[dtype].is_floating_point and set(collectives) & REDUCING:
        raise ValueError(f"--op avg is not defined for {dtype}: use --op sum or a floating --dtype")
    if not (args.root == ALL_ROOTS or 0 <= args.root < world_size):
        raise ValueError(f"--root {args.root} is outside 0..{world_size - 1} (or -1 for every root)")
    if args.inject_error is not None and not 0 <= args.inject_error < world_size:
        raise ValueError(f"--inject-error {args.inject_error} is outside 0..{world_size - 1}")
    if args.skew != 1 and (args.skew < 1 or collectives != ("all_to_all",)):
        raise ValueError(f"--skew {args.skew} applies to all_to_all alone, as a whole number >= 1")
    if args.ceiling is not None and not args.ceiling > 0:
        raise ValueError(f"--ceiling must be a positive bandwidth in GB/s, got {args.ceiling}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be positive seconds, got {args.timeout}")
    check_output("--json", args.json)
    check_plot("--plot", args.plot)
    default_backend = "nccl" if torch.cuda.is_available() else "gloo"
    backends = tuple(
        check_backend(name, allow_auto=False, what="--backend")
        for name in _split(args.backend or default_backend, "--backend")
    )
    _check_backends(backends)
    _check_memory(collectives, sizes[-1], world_size, (local_ranks, gpu_ranks), backends, args)
    algorithms = tuple(dict.fromkeys(canonical_algorithm(n) for n in _split(args.algo, "--algo")))
    if args.collective not in (None, "all"):
        _check_coverage(args.collective, algorithms)
    # a missing or malformed file fails here, before any rank starts; a calibrating run prices auto with
    # what its target file held before (the built-in calibration for a new file)
    pricing_file = args.calibration_file
    if args.calibrate:
        target = calibration_target(args.calibration_file)
        previous_calibration(target)
        pricing_file = str(target) if target.exists() else None
    elif args.calibration_file is not None:
        try:
            Calibration.load(args.calibration_file)
        except FileNotFoundError:
            file = source_of(args.calibration_file)
            raise ValueError(
                f"--calibration-file {file} does not exist; write it with --calibrate first"
            ) from None
    sweep = SweepConfig(
        collective=collectives[0] if collectives else "all_reduce",
        sizes=tuple(sizes),
        dtype=dtype,
        op=args.op,
        root=args.root,
        iters=args.iters,
        warmup=args.warmup,
        checks=args.check,
        timing=args.timing,
        average=default_average(args.timing) if args.average is None else args.average,
        skew=args.skew,
        corrupt_rank=args.inject_error,
    )
    job = BenchJob(
        collectives=collectives,
        backends=backends,
        algorithms=algorithms,
        sweep=sweep,
        timeout=wait_timeout(args.timeout),
        calibrate=args.calibrate,
        calibration_file=args.calibration_file,
        pricing_file=pricing_file,
    )
    return job, world_size, launcher


def run_job(job: BenchJob, world_size: int, launcher: str, timeout: float, sink: Sink) -> JobResult | None:
    """Run on the launcher's ranks, in this process (one rank), or on spawned local ranks. Rank 0's
    events reach ``sink`` as they happen, through a pipe whichever process rank 0 is."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    thread = pump(reader, emitter(sink))
    try:
        result = run_on_ranks(bench_rank_main, (job, writer), nproc=world_size, default=2, deadline=timeout)
    finally:  # the ranks are gone (spawn stops them): the pipe ends once this last writer closes
        writer.close()
        thread.join(_DRAIN_SECONDS)
        reader.close()
    if result is None or launcher != "local":
        return result
    return replace(result, launcher="local")  # spawned children only see the torchrun-style variables


def _plot_calibration(args: argparse.Namespace) -> Calibration | None:
    """The calibration this run named or wrote, for the plot's model lines (the built-in values describe
    another machine, so they draw none)."""
    if args.calibrate:
        return Calibration.load(calibration_target(args.calibration_file))
    return Calibration.load(args.calibration_file) if args.calibration_file is not None else None


def replay_command(
    args: argparse.Namespace, job: BenchJob, world_size: int, launcher: str
) -> tuple[str, ...]:
    """The run spelled out with every option's effective value, so the record says how to repeat it
    (whatever defaults a later version has, and however the command was typed or launched)."""
    sweep = job.sweep
    factor, step_bytes = _stepping(args)
    step = ("-f", str(factor)) if factor is not None else ("-i", str(step_bytes))
    words = ["meshwise", "bench"]
    words += [args.collective] if args.collective is not None else []
    words += ["-np", str(world_size)] if launcher == "local" else []
    words += ["-b", args.minbytes, "-e", args.maxbytes, *step]
    words += ["-n", str(sweep.iters), "-w", str(sweep.warmup)]
    words += ["--timing", sweep.timing, "-a", str(sweep.average)]
    words += ["--skew", str(sweep.skew)] if sweep.skew != 1 else []
    words += ["-c", str(sweep.checks), "--dtype", sweep.dtype, "--op", sweep.op, "--root", str(sweep.root)]
    words += ["--backend", ",".join(job.backends), "--algo", ",".join(job.algorithms)]
    words += ["--calibrate"] if job.calibrate else []
    words += ["--calibration-file", args.calibration_file] if args.calibration_file else []
    return tuple(words)


def _header(job: BenchJob, world_size: int, launcher: str) -> str:
    sweep = job.sweep
    return (
        f"# meshwise bench · {world_size} ranks ({launcher}) · {sweep.dtype} · "
        f"iters {sweep.iters} · warmup {sweep.warmup} · checks {sweep.checks}"
        f"{f' · skew {sweep.skew} (rank 0 hot)' if sweep.skew != 1 else ''}\n"
        f"# {describe_timing(sweep)}\n"
        f"# calibration (prices auto): {source_of(job.pricing_file)}"
    )


def _write_outputs(
    args: argparse.Namespace,
    job: BenchJob,
    runs: list[RunResult],
    world_size: int,
    launcher: str,
    incomplete: str | None = None,
) -> bool:
    """The JSON and the plot of ``runs`` (all of them, or those that finished before ``incomplete``)."""
    from meshwise.bench.plot import plot_runs

    sweep = job.sweep
    record = BenchRecord(
        launcher=launcher,
        world_size=world_size,
        config={
            "dtype": sweep.dtype,
            "op": sweep.op,
            "root": sweep.root,
            "iters": sweep.iters,
            "warmup": sweep.warmup,
            "checks": sweep.checks,
            "timing": sweep.timing,
            "average": sweep.average,
            "skew": sweep.skew,
            "calibration": source_of(job.pricing_file),
        },
        runs=tuple(runs),
        timing=describe_timing(sweep),
        command=replay_command(args, job, world_size, launcher),
        incomplete=incomplete,
    )
    rows = sum(len(run.rows) for run in runs)
    finished = f" of the {rows} finished rows" if incomplete else ""
    writers = []
    if args.json:
        writers.append((f"JSON{finished}", args.json, lambda: write_json(args.json, record)))
    if args.plot and rows:
        title = f"meshwise bench · {world_size} ranks · {sweep.dtype}"
        calibration = _plot_calibration(args)

        def draw() -> None:
            plot_runs(runs, args.plot, ceiling_gbps=args.ceiling, calibration=calibration, title=title)

        writers.append((f"plot{finished}", args.plot, draw))
    return write_outputs("bench", writers)


def _report(
    args: argparse.Namespace, job: BenchJob, result: JobResult, live: LiveReport, seconds: float
) -> int:
    console = output_console()
    sweep = job.sweep
    live.print_header()
    runs = list(result.runs)
    if result.calibration is not None:
        print_runs(result.calibration.runs, console, checked=False)
        console.print(format_outcome(result.calibration))
        runs = runs or list(result.calibration.runs)
    for note in result.notes:
        console.print(f"# note: {note}")
    written = _write_outputs(args, job, runs, result.world_size, result.launcher)
    console.print(f"Wall time = {seconds:.3f} s")
    failed = [run for run in result.runs if not run.ok]
    if failed and sweep.checks > 0:
        for run in failed:
            print(
                f"meshwise bench: check FAILED for {run.collective} on {run.backend}/{run.algorithm}: "
                f"{run.wrong} wrong elements, {run.out_of_bounds} out-of-bounds writes",
                file=sys.stderr,
            )
        return 1
    return 0 if written else 1


def handler(args: argparse.Namespace) -> int:
    try:
        job, world_size, launcher = build_job(args)
    except ValueError as exc:
        print(f"meshwise bench: error: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    bar = sys.stderr.isatty() and detect_launch_env().rank == 0  # one bar per job, not one per rank
    live = LiveReport(_header(job, world_size, launcher), checked=job.sweep.checks > 0, progress=bar)
    try:
        with live:
            result = run_job(job, world_size, launcher, args.timeout, live.handle)
    except ValueError as exc:
        print(f"meshwise bench: error: {exc}", file=sys.stderr)
        return 2
    except (SpawnError, CommError) as exc:
        print(f"meshwise bench: {exc}", file=sys.stderr)
        _keep_finished(args, job, live, world_size, launcher, str(exc).splitlines()[0])
        return 1
    except KeyboardInterrupt:
        print("meshwise bench: SIGINT received, stopped", file=sys.stderr)
        _keep_finished(args, job, live, world_size, launcher, "interrupted (SIGINT)")
        return 130
    if result is None:  # not rank 0 of a launched job: rank 0 reports
        return 0
    return _report(args, job, result, live, time.perf_counter() - start)


def _keep_finished(
    args: argparse.Namespace, job: BenchJob, live: LiveReport, world_size: int, launcher: str, why: str
) -> None:
    """After a failure: write what finished, marked ``incomplete`` with the reason (only the process
    that received rank 0's rows has any)."""
    if live.finished_rows:
        _write_outputs(args, job, live.runs, world_size, launcher, incomplete=why)
