"""meshwise train gpt: GPT language-model training on a device mesh, offline by default.

Trains on this Python installation's standard library source (byte tokens, built once and cached) unless
--data PATH names a text file or a flat uint16 .bin token file. The global batch is fixed; with
more ranks each takes a smaller slice, and --micro-batch-size (or --micro-batches) splits a rank's
slice into accumulated micro-batches, so the run computes the same thing on any number of ranks.
"""

from __future__ import annotations

import argparse
import sys

from meshwise.cli.section_flags import add_mesh_flags, add_output_flags, add_timeout_flag
from meshwise.cli.training_failure import run_training_command
from meshwise.models.gpt import CONFIGS
from meshwise.parallel.pipeline_parallel.schedules import SCHEDULES
from meshwise.train.gpt import GPTTrainConfig, run_gpt_training
from meshwise.train.gpt.sections import LR_SCHEDULES

_DEFAULTS = GPTTrainConfig.flag_defaults()


def add_parser(models: argparse._SubParsersAction) -> None:
    parser = models.add_parser(
        "gpt",
        help="GPT-2 language model on a dp×tp×pp mesh (DDP, ZeRO, TP+SP, pipelines), bundled corpus",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = _DEFAULTS
    ranks = parser.add_argument_group("ranks and mesh")
    add_mesh_flags(ranks, d)
    ranks.add_argument(
        "--dp", type=int, default=d["dp"], help="data-parallel size (default: ranks / (tp·pp·cp·ep))"
    )
    ranks.add_argument(
        "--tp",
        type=int,
        default=d["tp"],
        help="tensor-parallel size, divides the heads (default %(default)s)",
    )
    ranks.add_argument(
        "--pp", type=int, default=d["pp"], help="pipeline-parallel size: stages (default %(default)s)"
    )
    ranks.add_argument(
        "--cp",
        type=int,
        default=d["cp"],
        help="context-parallel size: each sequence split over cp ranks, 2·cp chunks (default %(default)s)",
    )
    ranks.add_argument(
        "--sp", action="store_true", default=d["sp"], help="sequence parallelism, with --tp (default off)"
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--config",
        default=d["config"],
        help=f"named size: {', '.join(CONFIGS)} (default gpt-nano, or the --init-from checkpoint's)",
    )
    model.add_argument(
        "--init-from",
        default=d["init_from"],
        metavar="PATH",
        help="start from Hugging Face GPT-2 weights: model.safetensors, pytorch_model.bin or their folder "
        "(its config.json gives the architecture); --resume wins over it (default: none)",
    )
    for flag in ("layers", "hidden", "heads", "vocab"):
        model.add_argument(
            f"--{flag}",
            type=int,
            default=d[flag],
            help=f"override the config's {flag} (default: the config's)",
        )
    model.add_argument(
        "--seq-len",
        type=int,
        default=d["seq_len"],
        help="training context (default: the config's, at most 128 on a CPU)",
    )
    experts = parser.add_argument_group("mixture of experts")
    experts.add_argument(
        "--experts", type=int, default=d["experts"], help="experts per MLP, 0 = dense (default: the config's)"
    )
    experts.add_argument("--top-k", type=int, default=d["top_k"], help="experts per token (default 2)")
    experts.add_argument(
        "--ep",
        type=int,
        default=d["ep"],
        help="expert-parallel size: each rank holds E/ep experts, tokens travel by all-to-all; ep ranks "
        "are carved from the data-parallel ranks (default %(default)s)",
    )
    experts.add_argument(
        "--capacity-factor",
        type=float,
        default=d["capacity_factor"],
        help="cap per expert ⌈c·T·k/E⌉ (default dropless)",
    )
    experts.add_argument(
        "--aux-loss-coef",
        type=float,
        default=d["aux_loss_coef"],
        help="load-balancing loss coefficient (default 0.01)",
    )
    experts.add_argument(
        "--z-loss-coef",
        type=float,
        default=d["z_loss_coef"],
        help="router z-loss coefficient (default 0.001)",
    )
    run = parser.add_argument_group("optimisation")
    run.add_argument("--steps", type=int, default=d["steps"], help="optimizer steps (default %(default)s)")
    run.add_argument(
        "--global-batch",
        type=int,
        default=d["global_batch"],
        help="sequences per step, all ranks (default %(default)s)",
    )
    run.add_argument(
        "--micro-batch-size",
        dest="micro_batch",
        type=int,
        default=d["micro_batch"],
        metavar="SIZE",
        help="SIZE of a micro-batch: sequences per rank per forward, accumulated (default: the whole "
        "per-rank batch; under --pp, that batch in up to 4·pp micro-batches)",
    )
    run.add_argument(
        "--micro-batches",
        type=int,
        default=d["micro_batches"],
        metavar="COUNT",
        help="NUMBER of micro-batches per rank per step, instead of --micro-batch-size (default: see it)",
    )
    run.add_argument(
        "--recompute",
        choices=("none", "selective", "full"),
        default=d["recompute"],
        help="activation recomputation: selective re-runs the attention core in backward, full each block "
        "(default %(default)s)",
    )
    run.add_argument(
        "--recompute-layers",
        type=int,
        default=d["recompute_layers"],
        metavar="K",
        help="with --recompute full: only the first K blocks of each pipeline stage (default: every block)",
    )
    # the earlier spelling of --micro-batch-size keeps working, out of sight: one letter from --micro-batches
    run.add_argument("--micro-batch", dest="micro_batch", type=int, help=argparse.SUPPRESS)
    pipe = parser.add_argument_group("pipeline (--pp > 1)")
    pipe.add_argument(
        "--schedule",
        default=d["schedule"],
        choices=SCHEDULES,
        help="pipeline schedule; zb is zero-bubble ZB-H1 (backward split into input- and weight-gradient "
        "halves, 1F1B's memory) (default %(default)s)",
    )
    pipe.add_argument(
        "--virtual-stages",
        type=int,
        default=d["virtual_stages"],
        help="chunks per rank, --schedule interleaved (default %(default)s)",
    )
    pipe.add_argument(
        "--timeline",
        default=d["timeline"],
        metavar="FILE",
        help="diagram of the last step, PNG (default: none)",
    )
    run.add_argument("--lr", type=float, default=d["lr"], help="peak learning rate (default %(default)s)")
    run.add_argument(
        "--warmup", type=int, default=d["warmup"], help="linear warmup steps (default: a tenth of --steps)"
    )
    run.add_argument(
        "--min-lr", type=float, default=d["min_lr"], help="floor the decay ends at (default %(default)s)"
    )
    run.add_argument(
        "--lr-schedule",
        choices=LR_SCHEDULES,
        default=d["lr_schedule"],
        help="decay after warmup; wsd holds the peak until the last 20 %% of the steps, then decays "
        "linearly (default %(default)s)",
    )
    run.add_argument(
        "--dropout",
        type=float,
        default=d["dropout"],
        help="dropout probability (default %(default)s)",
    )
    run.add_argument("--beta1", type=float, default=d["beta1"], help="AdamW beta1 (default %(default)s)")
    run.add_argument("--beta2", type=float, default=d["beta2"], help="AdamW beta2 (default %(default)s)")
    run.add_argument("--eps", type=float, default=d["eps"], help="AdamW epsilon (default %(default)s)")
    run.add_argument(
        "--weight-decay",
        type=float,
        default=d["weight_decay"],
        help="AdamW decay of matrices (default %(default)s)",
    )
    run.add_argument(
        "--grad-clip",
        type=float,
        default=d["grad_clip"],
        help="max gradient norm, 0 = off (default %(default)s)",
    )
    run.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default=d["dtype"],
        help="compute precision; fp16 with --zero (default %(default)s)",
    )
    run.add_argument(
        "--seed", type=int, default=d["seed"], help="initial weights and data order (default %(default)s)"
    )
    run.add_argument(
        "--compile",
        action="store_true",
        default=d["compile"],
        help="torch.compile each transformer block; on a CPU this needs a C++ compiler (gcc or clang)",
    )
    io = parser.add_argument_group("data, evaluation, output")
    io.add_argument(
        "--data",
        default=d["data"],
        metavar="PATH",
        help="text file (read as bytes), or uint16 .bin token file (default: this Python's standard library)",
    )
    io.add_argument(
        "--tokenizer",
        default=d["tokenizer"],
        metavar="PATH",
        help="tokenizer.json (or its folder) to tokenize a text --data with, cached beside it as .bin, and "
        "to decode --sample; local files only (default: the --init-from folder's, else bytes)",
    )
    io.add_argument(
        "--cache-dir",
        default=d["cache_dir"],
        metavar="DIR",
        help="where the default corpus is built once and cached (default: meshwise's cache directory)",
    )
    io.add_argument(
        "--eval-every", type=int, default=d["eval_every"], help="validate every N steps (default %(default)s)"
    )
    io.add_argument(
        "--eval-windows", type=int, default=d["eval_windows"], help="validation windows (default %(default)s)"
    )
    add_output_flags(io, d, checkpoint_help="DCP checkpoint at every validation (default: none)")
    add_timeout_flag(io, d)
    io.add_argument(
        "--checkpoint-every",
        type=int,
        default=d["checkpoint_every"],
        metavar="N",
        help="checkpoint every N steps and at the end instead (default: at every validation)",
    )
    io.add_argument(
        "--keep",
        type=int,
        default=d["keep"],
        metavar="K",
        help="latest checkpoints kept (default %(default)s)",
    )
    io.add_argument(
        "--export-hf",
        default=d["export_hf"],
        metavar="DIR",
        help="write the trained weights as Hugging Face GPT-2 (default: none)",
    )
    io.add_argument(
        "--sample",
        type=int,
        default=d["sample"],
        metavar="N",
        help="print N generated tokens at the end (default %(default)s)",
    )
    io.add_argument(
        "--comm-stats",
        action="store_true",
        default=d["comm_stats"],
        help="count calls and bytes of every collective per mesh axis",
    )
    io.add_argument(
        "--log-every",
        type=int,
        default=d["log_every"],
        metavar="N",
        help="also print a progress line every N steps, terminal or not (default: at evaluations only)",
    )
    io.add_argument(
        "--tensorboard",
        default=d["tensorboard"],
        metavar="DIR",
        help="TensorBoard event files of the reported steps in DIR, needs meshwise[tensorboard] "
        "(default: none)",
    )
    io.add_argument(
        "--metrics",
        default=d["metrics"],
        metavar="FILE",
        help="append one JSON line per reported step to FILE as the run goes (default: none)",
    )
    measure = parser.add_argument_group("profile")
    measure.add_argument(
        "--profile",
        action="store_true",
        default=d["profile"],
        help="time each step (data, forward, backward, exposed/hidden communication, optimizer, pipeline "
        "bubble) and print the breakdown with a verdict",
    )
    measure.add_argument(
        "--trace",
        default=d["trace"],
        metavar="FILE",
        help="Chrome/Perfetto trace of every rank's steps: phases, communication and, with --pp, the "
        "pipeline instructions; implies --profile (default: none)",
    )
    measure.add_argument(
        "--torch-profile",
        default=d["torch_profile"],
        metavar="DIR",
        help="torch.profiler's operators (and CUDA kernels) of a few steps, DIR/rank{R}.json (default: none)",
    )
    ranks.add_argument(
        "--auto",
        action="store_true",
        help="plan the layouts of -np ranks, try the top 3 for a few steps, keep the fastest (default: off)",
    )
    parser.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    if getattr(args, "auto", False):  # meshwise plan picks the layout (cli/train_auto.py)
        if args.cp != 1:  # the planner's layouts have no cp axis yet
            print("meshwise train gpt: error: --auto plans dp, tp and pp only: drop --cp", file=sys.stderr)
            return 2
        from meshwise.cli.train_auto import run_auto

        return run_auto(args, handler)
    config = GPTTrainConfig.from_flags(**{k: v for k, v in vars(args).items() if k in _DEFAULTS})
    return run_training_command("train gpt", args, lambda: run_gpt_training(config))
