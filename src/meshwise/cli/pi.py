"""``meshwise pi {midpoint,montecarlo} N [SEED]``: the lecture's π exercises on any number of ranks.

With ``-np P`` it starts P local ranks itself; under a launcher (``meshwise run``, torchrun, mpirun, srun)
it runs on the ranks it was started on and rank 0 prints. Inputs are checked before any rank starts.
"""

from __future__ import annotations

import argparse
import sys
from decimal import Decimal, InvalidOperation

import torch

from meshwise.cli import summary
from meshwise.comm.factory import BACKENDS
from meshwise.runtime.env import plan_ranks
from meshwise.runtime.spawn import SpawnError, spawn
from meshwise.workloads.pi import METHODS, check_work
from meshwise.workloads.pi_job import KERNELS, PiReport, pi_rank_main

#: The Communicator timeout never exceeds this; the job deadline (--timeout) bounds the whole run.
_COMM_TIMEOUT_CAP = 300.0


def parse_count(text: str) -> int:
    """An exact integer from ``10000``, ``10_000`` or ``1e13`` (refusing fractions like ``1.5``)."""
    try:
        value = Decimal(text.replace("_", ""))
    except InvalidOperation:
        raise ValueError(f"N={text!r} is not a number; pass an integer such as 10000 or 1e13") from None
    if not value.is_finite() or value != value.to_integral_value():
        raise ValueError(f"N={text!r} is not a whole number of samples/bins")
    return check_work(int(value))


def check_backend(name: str) -> str:
    """Refuse an unknown backend name before any rank starts."""
    if name != "auto" and name not in BACKENDS:
        raise ValueError(
            f"--backend {name!r} is unknown; choose auto or one of {', '.join(sorted(BACKENDS))}"
        )
    return name


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=summary(__doc__))
    parser.add_argument("method", choices=METHODS, help="midpoint-rule integration or Monte Carlo sampling")
    parser.add_argument("n", metavar="N", help="bins (midpoint) or samples (montecarlo), e.g. 10000 or 1e13")
    parser.add_argument(
        "seed_arg",
        nargs="?",
        type=int,
        metavar="SEED",
        help="Monte Carlo stream, as the lecture's `mpi_cuda_pi_mc.x N SEED` (same as --seed)",
    )
    parser.add_argument("-np", "--nproc", dest="np", type=int, default=None, help="local ranks to start")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if present")
    parser.add_argument("--seed", type=int, default=None, help="Monte Carlo stream (default 0)")
    parser.add_argument("--backend", default="auto", help="communicator backend (auto, gloo, nccl, shm, mpi)")
    parser.add_argument("--chunk", type=int, default=None, help="items per kernel call (bounds memory)")
    parser.add_argument(
        "--kernel",
        choices=KERNELS,
        default="auto",
        help="eager torch ops, or one compiled fused loop (auto: by size)",
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="deadline for the whole job, seconds")
    parser.set_defaults(func=handler)


def _seed(args: argparse.Namespace) -> int:
    """The seed, given positionally (the lecture's spelling) or with --seed; both must agree."""
    if args.seed_arg is not None and args.method != "montecarlo":
        raise ValueError(f"{args.method} takes no SEED ({args.seed_arg}); only montecarlo samples randomly")
    if args.seed_arg is not None and args.seed not in (None, args.seed_arg):
        raise ValueError(f"SEED {args.seed_arg} and --seed {args.seed} disagree; give one of them")
    return next((s for s in (args.seed_arg, args.seed) if s is not None), 0)


def _validate(args: argparse.Namespace) -> int:
    n = parse_count(args.n)
    args.seed = _seed(args)
    if args.np is not None and args.np < 1:  # checked again by plan_ranks; refused here before any work
        raise ValueError(f"-np must be at least 1, got {args.np}")
    if not 0 <= args.seed < 2**64:
        raise ValueError(f"--seed must be in 0 .. 2**64-1, got {args.seed}")
    check_backend(args.backend)
    if args.chunk is not None and args.chunk < 1:
        raise ValueError(f"--chunk must be a positive number of items, got {args.chunk}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be positive seconds, got {args.timeout}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available here; use --device cpu")
    return n


def run_job(args: argparse.Namespace, n: int, repeat: int = 1) -> list[PiReport] | None:
    """Run on the launcher's ranks, or spawn ``-np`` local ranks; the reports (None off rank 0)."""
    comm_timeout = min(args.timeout, _COMM_TIMEOUT_CAP)
    job = (args.method, n, args.seed, args.backend, args.device, args.chunk, repeat, comm_timeout)
    job += (None, False, args.kernel, True)  # default threads, no warm-up run, progress on stderr
    plan = plan_ranks(args.np, default=1)
    if plan.launched:
        reports = pi_rank_main(*job)
        return reports if plan.layout.rank == 0 else None
    if plan.world_size == 1:
        return pi_rank_main(*job)
    return spawn(pi_rank_main, plan.world_size, job, timeout=args.timeout)[0]


def handler(args: argparse.Namespace) -> int:
    try:
        n = _validate(args)
    except ValueError as exc:
        print(f"meshwise pi: error: {exc}", file=sys.stderr)
        return 2
    try:
        reports = run_job(args, n)
    except ValueError as exc:
        print(f"meshwise pi: error: {exc}", file=sys.stderr)
        return 2
    except SpawnError as exc:
        print(f"meshwise pi: {exc}", file=sys.stderr)
        return 1
    if reports:
        print(reports[-1].format(), flush=True)
    return 0
