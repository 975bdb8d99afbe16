"""meshwise scale WORKLOAD --np 1,2,4: run a workload at several rank counts and judge its scaling.

WORKLOAD is ``pi-midpoint``, ``pi-montecarlo``, ``train:<model>`` or, after ``--``, any command with
``{np}`` (rank count) and optionally ``{work}`` (work size) in its arguments; commands report their wall
time with a ``Wall time = <seconds> s`` line. Every scale runs ``--repeat`` times and the median counts.
"""

from __future__ import annotations

import argparse
import sys

import torch

from meshwise.cli import summary
from meshwise.cli.outputs import check_output, check_plot, write_outputs
from meshwise.cli.pi import parse_count
from meshwise.comm.cost import Calibration
from meshwise.comm.factory import check_backend
from meshwise.runtime.cores import available_cores
from meshwise.runtime.spawn import SpawnError
from meshwise.scale.metrics import MODES, Sample, analyse
from meshwise.scale.model import predicted_times
from meshwise.scale.report import format_table, plot, to_json, write_json
from meshwise.scale.runner import ScaleError, Workload, cores_busy, parse_workload, run_command, run_pi
from meshwise.train.workloads import WORKLOADS as TRAIN_MODELS
from meshwise.workloads.pi import check_work
from meshwise.workloads.pi_job import KERNELS, resolve_kernel

_DEFAULT_PI_WORK = {"midpoint": 20_000_000, "montecarlo": 20_000_000}
_PI_PAYLOAD_BYTES = 8  # one int64 hit count or one float64 partial sum


def parse_scales(text: str) -> list[int]:
    """``1,2,4`` → [1, 2, 4] (sorted, distinct, positive)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--np {text!r} must be comma-separated rank counts such as 1,2,4") from None
    if not values or min(values) < 1 or len(set(values)) != len(values):
        raise ValueError(f"--np {text!r} must list distinct positive rank counts such as 1,2,4")
    return sorted(values)


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=summary(__doc__))
    parser.add_argument(
        "workload", nargs="+", help="pi-midpoint | pi-montecarlo | train:<model> | -- CMD ARGS"
    )
    parser.add_argument(
        "-np", "--np", "--nproc", dest="scales", default="1,2,4", help="rank counts to run (default 1,2,4)"
    )
    parser.add_argument(
        "--mode", choices=MODES, default="strong", help="fixed work (strong) or work ∝ n (weak)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="runs per scale; the median counts (default 3)")
    parser.add_argument("--work", default=None, help="work size: π samples/bins, or {work} in a command")
    parser.add_argument("--seed", type=int, default=0, help="Monte Carlo stream of the π workloads")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="device of the π workloads")
    parser.add_argument("--backend", default="auto", help="communicator backend of the π workloads")
    parser.add_argument("--kernel", choices=KERNELS, default="auto", help="π kernel, fixed for all scales")
    parser.add_argument("--comm-bytes", type=int, default=None, help="bytes all-reduced per run (cost model)")
    parser.add_argument("--calibration", default=None, help="cost-model calibration file (default: built-in)")
    parser.add_argument("--timeout", type=float, default=600.0, help="deadline of each run, seconds")
    parser.add_argument("--json", default=None, help="write the study as JSON here")
    parser.add_argument("--plot", default=None, help="write time and efficiency plots here (PNG/PDF/SVG)")
    parser.set_defaults(func=handler)


def _validate(args: argparse.Namespace) -> tuple[Workload, list[int], int | None]:
    workload = parse_workload(args.workload)
    model = workload.name.removeprefix("train:") if workload.name.startswith("train:") else None
    if model is not None and model not in TRAIN_MODELS:
        raise ValueError(
            f"{workload.name}: `meshwise train` has no model {model!r}; use train:<model> with one of "
            f"{', '.join(TRAIN_MODELS)}"
        )
    scales = parse_scales(args.scales)
    if args.repeat < 1:
        raise ValueError(f"--repeat must be at least 1, got {args.repeat}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be positive seconds, got {args.timeout}")
    work = parse_count(args.work) if args.work is not None else None
    check_backend(args.backend, what="--backend")
    if not 0 <= args.seed < 2**64:
        raise ValueError(f"--seed must be in 0 .. 2**64-1, got {args.seed}")
    if workload.is_command:
        uses_work = any("{work}" in token for token in workload.argv)
        if uses_work and work is None:
            raise ValueError("the command uses {work}: pass --work N")
        if args.mode == "weak" and not uses_work:
            raise ValueError(
                "weak scaling grows the work with n: put {work} in the command and pass --work N"
            )
    else:
        work = work or _DEFAULT_PI_WORK[workload.method]
        if args.mode == "weak":
            check_work(work * scales[-1], what=f"--work × {scales[-1]} ranks")
        if args.device == "cuda" and torch.cuda.device_count() < scales[-1]:
            raise ValueError(
                f"--device cuda needs {scales[-1]} GPUs here, {torch.cuda.device_count()} visible"
            )
    check_output("--json", args.json)
    check_plot("--plot", args.plot)
    return workload, scales, work


def _measure(
    args: argparse.Namespace, workload: Workload, ranks: int, work: int | None, base_ranks: int
) -> tuple[list[Sample], set[str]]:
    """The runs at one scale and where their times came from; the π kernel is chosen from the baseline's
    per-rank share so every scale uses the same one."""
    scaled = None if work is None else (work * ranks if args.mode == "weak" else work)
    if workload.is_command:
        runs = [run_command(workload.argv, ranks, scaled, args.timeout) for _ in range(args.repeat)]
        return [sample for sample, _ in runs], {source for _, source in runs}
    share = work if args.mode == "weak" else -(-work // base_ranks)
    samples = run_pi(
        workload.method,
        ranks,
        scaled,
        repeat=args.repeat,
        seed=args.seed,
        device=args.device,
        backend=args.backend,
        timeout=args.timeout,
        kernel=resolve_kernel(args.kernel, share),
    )
    return samples, {"reported"}


def handler(args: argparse.Namespace) -> int:
    try:
        workload, scales, work = _validate(args)
        calibration = Calibration.from_option(args.calibration)
    except (ValueError, ImportError, FileNotFoundError) as exc:
        print(f"meshwise scale: error: {exc}", file=sys.stderr)
        return 2
    cores = available_cores()
    gpu_run = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
    on_cpu = workload.is_command or not gpu_run
    print(f"meshwise scale: {workload.name} | {args.mode} scaling | work = {work} | {args.repeat} runs/scale")
    print(f"Cores: {cores}")
    print(f"Cost-model calibration: {calibration.source}")
    if on_cpu and scales[-1] > cores:
        print(
            f"warning: {scales[-1]} ranks exceed the {cores} cores here; CPU ranks beyond {cores} share "
            "cores, so speedup past that is not expected",
            file=sys.stderr,
        )
    samples: dict[int, list[Sample]] = {}
    sources: set[str] = set()
    baseline_cores = None
    try:
        for ranks in scales:
            # progress: a study of big runs is silent for minutes otherwise
            print(f"n={ranks}: running {args.repeat} run{'s' if args.repeat > 1 else ''} …", flush=True)
            (samples[ranks], used), busy = cores_busy(
                lambda ranks=ranks: _measure(args, workload, ranks, work, scales[0])
            )
            baseline_cores = busy if ranks == 1 and on_cpu else baseline_cores
            sources |= used
            times = " ".join(f"{s.wall_seconds:.6f}" for s in samples[ranks])
            print(f"n={ranks}: {times} s", flush=True)
    except (ScaleError, SpawnError) as exc:
        print(f"meshwise scale: {exc}", file=sys.stderr)
        return 1
    points = analyse(args.mode, samples, cores if on_cpu else None, baseline_cores)
    comm_bytes = (
        args.comm_bytes
        if args.comm_bytes is not None
        else (None if workload.is_command else _PI_PAYLOAD_BYTES)
    )
    model = predicted_times(args.mode, points, comm_bytes, calibration) if comm_bytes else None
    print()
    print(format_table(args.mode, points, unit="GPUs" if not on_cpu else "Ranks"))
    time_source = "process" if "process" in sources else "reported"
    if time_source == "process":
        print("\nnote: the command printed no `Wall time = X s` line; times include process start-up")
    writers = []
    if args.json:
        record = to_json(
            workload=workload.name,
            mode=args.mode,
            cores=cores,
            work=work,
            time_source=time_source,
            points=points,
            model=model,
        )
        writers.append(("JSON", args.json, lambda: write_json(args.json, record)))
    if args.plot:
        title = f"{workload.name} — {args.mode} scaling ({cores} cores)"
        writers.append(("plot", args.plot, lambda: plot(args.plot, args.mode, points, model, title)))
    return 0 if write_outputs("scale", writers) else 1
