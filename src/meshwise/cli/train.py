"""``meshwise train {mlp,deep-mlp,cnn,gpt}``: data-parallel training with progress, validation, checkpoints.

With ``-np N`` it starts N local ranks itself; under a launcher (``meshwise run``, torchrun, mpirun, srun)
it trains on the ranks it was started on. Every setting is checked before any rank starts. ``gpt`` has
its own flags (:mod:`meshwise.cli.train_gpt`).
"""

from __future__ import annotations

import argparse
import sys

from meshwise.cli import summary, train_gpt
from meshwise.cli.section_flags import add_mesh_flags, add_output_flags, add_timeout_flag
from meshwise.cli.training_failure import run_training_command
from meshwise.train import WORKLOADS, TrainConfig, run_training
from meshwise.train.checkpoint import resume_requested

_DEFAULTS = TrainConfig.flag_defaults()


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=summary(__doc__))
    models = parser.add_subparsers(dest="model", metavar="MODEL", required=True)
    for workload in WORKLOADS.values():
        add_workload_parser(models, workload.name, workload.summary)
    train_gpt.add_parser(models)


def add_workload_parser(models: argparse._SubParsersAction, model: str, blurb: str) -> None:
    parser = models.add_parser(model, help=blurb, description=f"{summary(__doc__)}\n\n{blurb}")
    d = _DEFAULTS
    add_mesh_flags(parser, d)
    parser.add_argument("--epochs", type=int, default=d["epochs"], help="total epochs (default: per model)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=d["batch_size"],
        help="samples per rank per step (default: per model)",
    )
    parser.add_argument(
        "--lr", type=float, default=d["lr"], help="learning rate for one rank (default: per model)"
    )
    parser.add_argument(
        "--no-lr-scaling",
        dest="lr_scaling",
        action="store_false",
        default=d["lr_scaling"],
        help="keep --lr as is instead of multiplying it by the number of ranks",
    )
    # the spelling before --zero: refused in one line that names the new flag (see handler)
    parser.add_argument("--strategy", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--seed", type=int, default=d["seed"], help="initial weights and shuffling (default %(default)s)"
    )
    parser.add_argument(
        "--data", dest="data_dir", default=d["data_dir"], help="cnn only: a directory with MNIST IDX files"
    )
    add_output_flags(
        parser,
        d,
        checkpoint_help="checkpoint every epoch into DIR (run.json + step-N/, torch.distributed.checkpoint; "
        "resumes on any number of ranks and any --zero)",
    )
    add_timeout_flag(parser, d)
    parser.add_argument(
        "--profile",
        action="store_true",
        default=d["profile"],
        help="time each step (data, forward, backward, exposed/hidden communication, optimizer) and print "
        "the breakdown with a verdict",
    )
    parser.add_argument(
        "--trace",
        default=d["trace"],
        metavar="FILE",
        help="also write a Chrome/Perfetto trace (implies --profile)",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        default=d["debug"],
        help="check every collective across ranks before it runs",
    )
    parser.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    if args.strategy is not None:
        stage = args.strategy[-1] if args.strategy in ("zero1", "zero2", "zero3") else "0"
        print(f"meshwise train: error: --strategy is gone; ZeRO is --zero N (0|1|2|3), e.g. --zero {stage}",
              file=sys.stderr)  # fmt: skip
        return 2
    flags = {k: v for k, v in vars(args).items() if k in _DEFAULTS}
    resume = resume_requested(args.checkpoint, args.resume)
    config = TrainConfig.from_flags(args.model, **(flags | {"resume": resume}))
    return run_training_command("train", args, lambda: run_training(config))
