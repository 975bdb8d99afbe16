"""``meshwise train gpt``: GPT language-model training on a device mesh, offline by default.

Trains on this Python installation's standard library source (byte tokens, built once and cached) unless
``--data PATH`` names a text file or a flat uint16 ``.bin`` token file. The global batch is fixed; with
more ranks each takes a smaller slice, and ``--micro-batch`` splits a rank's slice into accumulated
micro-batches, so the run computes the same thing on any number of ranks.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from meshwise.cli.training_failure import run_training_command
from meshwise.models.gpt import CONFIGS
from meshwise.parallel.pipeline_parallel.schedules import SCHEDULES
from meshwise.train.gpt import GPTTrainConfig, run_gpt_training

_DEFAULTS = {f.name: f.default for f in fields(GPTTrainConfig)}


def add_parser(models: argparse._SubParsersAction) -> None:
    parser = models.add_parser(
        "gpt",
        help="GPT-2 language model on a dp×tp×pp mesh (DDP, ZeRO, TP+SP, pipelines), bundled corpus",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = _DEFAULTS
    ranks = parser.add_argument_group("ranks and mesh")
    ranks.add_argument("-np", "--nproc", dest="nproc", type=int, default=None, help="local ranks to start")
    ranks.add_argument("--dp", type=int, default=None, help="data-parallel size (default: ranks / (tp·pp))")
    ranks.add_argument("--tp", type=int, default=1, help="tensor-parallel size (must divide the heads)")
    ranks.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages)")
    ranks.add_argument(
        "--zero",
        type=int,
        default=0,
        choices=(0, 1, 2, 3),
        help="ZeRO stage over the dp ranks: 1 optimizer state, 2 +gradients, 3 +parameters (0 = off)",
    )
    ranks.add_argument("--sp", action="store_true", help="sequence parallelism, with --tp")
    ranks.add_argument("--backend", default="auto", help="communicator backend (auto, gloo, nccl, shm, mpi)")
    ranks.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if present")
    model = parser.add_argument_group("model")
    model.add_argument(
        "--config",
        default=None,
        help=f"named size: {', '.join(CONFIGS)} (default gpt-nano, or the --init-from checkpoint's)",
    )
    model.add_argument(
        "--init-from",
        default=None,
        metavar="PATH",
        help="start from Hugging Face GPT-2 weights: model.safetensors, pytorch_model.bin or their folder "
        "(its config.json gives the architecture); --resume wins over it",
    )
    for flag in ("layers", "hidden", "heads", "vocab"):
        model.add_argument(f"--{flag}", type=int, default=None, help=f"override the config's {flag}")
    model.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="training context (default: the config's; at most 128 on a CPU)",
    )
    run = parser.add_argument_group("optimisation")
    run.add_argument("--steps", type=int, default=d["steps"], help="optimizer steps (default %(default)s)")
    run.add_argument(
        "--global-batch", type=int, default=d["global_batch"], help="sequences per step, all ranks"
    )
    run.add_argument(
        "--micro-batch", type=int, default=None, help="sequences per rank per forward (accumulate)"
    )
    run.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="micro-batches per rank per step (instead of --micro-batch)",
    )
    pipe = parser.add_argument_group("pipeline (--pp > 1)")
    pipe.add_argument("--schedule", default=d["schedule"], choices=SCHEDULES, help="default %(default)s")
    pipe.add_argument(
        "--virtual-stages", type=int, default=1, help="chunks per rank (--schedule interleaved)"
    )
    pipe.add_argument("--timeline", default=None, metavar="FILE", help="diagram of the last step (PNG)")
    run.add_argument("--lr", type=float, default=d["lr"], help="peak learning rate (default %(default)s)")
    run.add_argument(
        "--warmup", type=int, default=d["warmup"], help="linear warmup steps (default %(default)s)"
    )
    run.add_argument("--min-lr", type=float, default=d["min_lr"], help="cosine floor (default %(default)s)")
    run.add_argument("--weight-decay", type=float, default=d["weight_decay"], help="AdamW decay of matrices")
    run.add_argument("--grad-clip", type=float, default=d["grad_clip"], help="max gradient norm, 0 = off")
    run.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default=d["dtype"],
        help="compute precision (fp16: with --zero)",
    )
    run.add_argument("--seed", type=int, default=0, help="initial weights and data order (default 0)")
    io = parser.add_argument_group("data, evaluation, output")
    io.add_argument("--data", default=None, metavar="PATH", help="text file, or uint16 .bin token file")
    io.add_argument("--eval-every", type=int, default=d["eval_every"], help="validate every N steps")
    io.add_argument("--eval-windows", type=int, default=d["eval_windows"], help="validation windows")
    io.add_argument("--checkpoint", default=None, metavar="DIR", help="DCP checkpoint at every validation")
    io.add_argument("--resume", action="store_true", help="continue the run checkpointed in --checkpoint DIR")
    io.add_argument(
        "--export-hf", default=None, metavar="DIR", help="write the trained weights as Hugging Face GPT-2"
    )
    io.add_argument("--sample", type=int, default=0, metavar="N", help="print N generated tokens at the end")
    io.add_argument(
        "--comm-stats", action="store_true", help="count calls and bytes of every collective per mesh axis"
    )
    io.add_argument("--json", default=None, metavar="FILE", help="write the run's metrics as JSON")
    measure = parser.add_argument_group("profile")
    measure.add_argument(
        "--profile",
        action="store_true",
        help="time each step (data, forward, backward, exposed/hidden communication, optimizer, pipeline "
        "bubble) and print the breakdown with a verdict",
    )
    measure.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="Chrome/Perfetto trace of every rank's steps: phases, communication and, with --pp, the "
        "pipeline instructions (implies --profile)",
    )
    measure.add_argument(
        "--torch-profile",
        default=None,
        metavar="DIR",
        help="torch.profiler's operators (and CUDA kernels) of a few steps, DIR/rank{R}.json",
    )
    io.add_argument("--timeout", type=float, default=3600.0, help="deadline for the whole job, seconds")
    ranks.add_argument(
        "--auto", action="store_true", help="plan the layouts of -np ranks, try the top 3, keep the fastest"
    )
    parser.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    if getattr(args, "auto", False):  # meshwise plan picks the layout (cli/train_auto.py)
        from meshwise.cli.train_auto import run_auto

        return run_auto(args, handler)
    names = {f.name for f in fields(GPTTrainConfig)}
    config = GPTTrainConfig(**{k: v for k, v in vars(args).items() if k in names})
    return run_training_command("train gpt", args, lambda: run_gpt_training(config))
