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
from meshwise.runtime.env import plan_ranks
from meshwise.runtime.memory import check_memory
from meshwise.runtime.on_ranks import run_on_ranks
from meshwise.runtime.spawn import SpawnError
from meshwise.workloads.pi import EAGER_BYTES_PER_ITEM, METHODS, check_work, default_chunk
from meshwise.workloads.pi_job import KERNELS, PiJob, pi_rank_main, resolve_kernel


def parse_count(text: str, what: str = "N") -> int:
    """An exact integer from ``10000``, ``10_000`` or ``1e13`` (refusing fractions like ``1.5``)."""
    try:
        value = Decimal(text.replace("_", ""))
    except InvalidOperation:
        raise ValueError(f"{what}={text!r} is not a number; pass an integer such as 10000 or 1e13") from None
    if not value.is_finite() or value != value.to_integral_value():
        raise ValueError(f"{what}={text!r} is not a whole number of samples/bins")
    return check_work(int(value), what)


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
    parser.add_argument("--chunk", default=None, help="items per kernel call, e.g. 65536 or 1e6")
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


def build_job(args: argparse.Namespace) -> PiJob:
    """The validated job; ValueError says which option to change."""
    if args.np is not None and args.np < 1:  # checked again by plan_ranks; refused here before any work
        raise ValueError(f"-np must be at least 1, got {args.np}")
    job = PiJob(
        method=args.method,
        n=parse_count(args.n),
        seed=_seed(args),
        backend=args.backend,
        device=args.device,
        chunk=None if args.chunk is None else parse_count(args.chunk, "--chunk"),
        kernel=args.kernel,
        timeout=args.timeout,
        progress=True,  # rank 0 on stderr: the kernel compile and a heartbeat while computing
    )
    _check_memory(job.validate(), args.np)
    return job


def _check_memory(job: PiJob, nproc: int | None) -> None:
    """Refuse an eager chunk that the CPU ranks on this machine cannot hold together (the fused kernel
    stores nothing per item; GPU ranks allocate on their devices)."""
    if job.device == "cuda" or (job.device is None and torch.cuda.is_available()):
        return
    plan = plan_ranks(nproc, default=1)
    share = -(-job.n // plan.world_size)
    if resolve_kernel(job.kernel, share) != "eager":
        return
    ranks = plan.layout.local_world_size if plan.launched else plan.world_size
    items = min(job.chunk or default_chunk(torch.device("cpu")), share)
    check_memory(
        EAGER_BYTES_PER_ITEM[job.method] * items * ranks,
        f"the eager kernel with chunks of {items:,} items on {ranks} rank{'s' if ranks > 1 else ''}",
        "lower --chunk (or use --kernel fused)",
    )


def handler(args: argparse.Namespace) -> int:
    try:
        job = build_job(args)
    except ValueError as exc:
        print(f"meshwise pi: error: {exc}", file=sys.stderr)
        return 2
    try:
        reports = run_on_ranks(pi_rank_main, (job,), nproc=args.np, default=1, deadline=job.timeout)
    except ValueError as exc:
        print(f"meshwise pi: error: {exc}", file=sys.stderr)
        return 2
    except SpawnError as exc:
        print(f"meshwise pi: {exc}", file=sys.stderr)
        return 1
    if reports:
        print(reports[-1].format(), flush=True)
    return 0
