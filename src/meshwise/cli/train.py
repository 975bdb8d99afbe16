"""``meshwise train {mlp,deep-mlp,cnn,gpt}``: data-parallel training with progress, validation, checkpoints.

With ``-np N`` it starts N local ranks itself; under a launcher (``meshwise run``, torchrun, mpirun, srun)
it trains on the ranks it was started on. Every setting is checked before any rank starts. ``gpt`` has
its own flags (:mod:`meshwise.cli.train_gpt`).
"""

from __future__ import annotations

import argparse

from meshwise.cli import summary, train_gpt
from meshwise.cli.training_failure import run_training_command
from meshwise.train import WORKLOADS, TrainConfig, run_training
from meshwise.train.checkpoint import resume_requested
from meshwise.train.config import STRATEGIES


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=summary(__doc__))
    models = parser.add_subparsers(dest="model", metavar="MODEL", required=True)
    for workload in WORKLOADS.values():
        add_workload_parser(models, workload.name, workload.summary)
    train_gpt.add_parser(models)


def add_workload_parser(models: argparse._SubParsersAction, model: str, blurb: str) -> None:
    parser = models.add_parser(model, help=blurb, description=f"{summary(__doc__)}\n\n{blurb}")
    parser.add_argument("-np", "--nproc", dest="np", type=int, default=None, help="local ranks to start")
    parser.add_argument("--epochs", type=int, default=None, help="total epochs (default: per model)")
    parser.add_argument("--batch-size", type=int, default=None, help="samples per rank per step")
    parser.add_argument(
        "--lr", type=float, default=None, help="learning rate for one rank (default: per model)"
    )
    parser.add_argument(
        "--no-lr-scaling",
        dest="lr_scaling",
        action="store_false",
        help="keep --lr as is instead of multiplying it by the number of ranks",
    )
    parser.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="ddp",
        help="ddp (replicas) or zero1/zero2/zero3 (shard optimizer state / + gradients / + parameters)",
    )
    parser.add_argument("--seed", type=int, default=0, help="initial weights and shuffling (default 0)")
    parser.add_argument("--backend", default="auto", help="communicator backend (auto, gloo, nccl, shm, mpi)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if present")
    parser.add_argument(
        "--data", dest="data_dir", default=None, help="cnn only: a directory with MNIST IDX files"
    )
    parser.add_argument(
        "--checkpoint", default=None, metavar="DIR", help="write DIR/checkpoint.pt every epoch"
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue the run checkpointed in --checkpoint DIR"
    )
    parser.add_argument("--json", default=None, metavar="FILE", help="write the run's metrics as JSON")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="time each step (data, forward, backward, exposed/hidden communication, optimizer) and print "
        "the breakdown with a verdict",
    )
    parser.add_argument(
        "--trace", default=None, metavar="FILE", help="also write a Chrome/Perfetto trace (implies --profile)"
    )
    parser.add_argument(
        "--debug", action="store_true", help="check every collective across ranks before it runs"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="a deadline for the whole job in seconds, exit 124 when passed (default: none; a hung "
        "collective is reported after 300 s whatever this says)",
    )
    parser.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    config = TrainConfig(
        model=args.model,
        nproc=args.np,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        lr_scaling=args.lr_scaling,
        seed=args.seed,
        backend=args.backend,
        device=args.device,
        checkpoint=args.checkpoint,
        resume=resume_requested(args.checkpoint, args.resume),
        data_dir=args.data_dir,
        timeout=args.timeout,
        strategy=args.strategy,
        profile=args.profile,
        trace=args.trace,
        debug=args.debug,
    )
    return run_training_command("train", args, lambda: run_training(config))
