"""meshwise plan: predict per-GPU memory and step time of every dp·tp·pp·ZeRO layout, and pick one.

The model is a named config (--config), a shape (--layers --hidden --heads --vocab --seq-len) or a size
(--params); the machine a --gpu preset (datasheet figures, each overridable) or ``cpu`` (this host,
measured). Fixing --tp/--pp/--dp/--zero/--micro-batch/--schedule/--recompute narrows the search; fixing
all of them prices one layout. ``--validate K`` runs the top K layouts that fit this machine for a few
steps of ``meshwise train gpt`` and compares prediction with measurement. docs/plan.md has the formulas.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from meshwise.cli import summary
from meshwise.cli.outputs import check_output, check_plot, write_outputs
from meshwise.plan import GPU_NAMES, ModelSpec, Precision, Problem, advise, hardware, with_overrides
from meshwise.plan.hardware import measure_cpu
from meshwise.plan.layout import RECOMPUTE, SCHEDULES, Layout, check
from meshwise.plan.report import plot, render, to_json

#: fixed-layout flags → Layout fields
FIXED = ("dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "schedule", "recompute")
#: the rank axes a layout multiplies into the GPUs
AXES = ("dp", "tp", "pp", "cp", "ep")


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    from meshwise.models.gpt_shape import CONFIGS

    parser = subparsers.add_parser(name, help=help_text, description=summary(__doc__))
    model = parser.add_argument_group("model")
    model.add_argument("--config", default=None, help=f"named GPT: {', '.join(CONFIGS)}")
    model.add_argument(
        "--params", type=float, default=None, help="a size, e.g. 7.5e9 (shape from Megatron's table)"
    )
    for flag in ("layers", "hidden", "heads", "vocab", "seq-len"):
        model.add_argument(f"--{flag}", type=int, default=None, help=f"the model's {flag}")
    model.add_argument("--experts", type=int, default=None, help="experts per MLP (mixture of experts)")
    model.add_argument("--top-k", type=int, default=None, help="experts per token (default 2)")
    train = parser.add_argument_group("training")
    train.add_argument(
        "--global-batch", type=int, default=None, help="sequences per step (default 1024; 8 on cpu)"
    )
    train.add_argument(
        "--dtype", choices=("bf16", "fp16", "fp32"), default=None, help="default bf16 (fp32 on cpu)"
    )
    train.add_argument("--optimizer", choices=("adam", "sgd"), default="adam", help="default adam")
    train.add_argument(
        "--tokens",
        type=float,
        default=None,
        help="training tokens for the days estimate (default 20 per parameter, Chinchilla)",
    )
    hw = parser.add_argument_group("hardware")
    hw.add_argument(
        "--gpu", default="a100-80gb", help=f"preset: {', '.join(GPU_NAMES)} (default %(default)s)"
    )
    hw.add_argument("--gpus", type=int, required=True, help="how many GPUs (ranks)")
    hw.add_argument("--peak-tflops", type=float, default=None, help="dense peak in --dtype")
    hw.add_argument("--memory-gb", type=float, default=None, help="memory per GPU")
    hw.add_argument("--gpus-per-node", type=int, default=None)
    for link in ("intra", "inter"):
        hw.add_argument(f"--{link}-gbs", type=float, default=None, help=f"{link}-node GB/s per direction")
        hw.add_argument(f"--{link}-us", type=float, default=None, help=f"{link}-node latency, µs")
    hw.add_argument(
        "--calibrate",
        action="store_true",
        help="measure the matmul-efficiency curve on this host's device (CUDA, or --gpu cpu)",
    )
    fixed = parser.add_argument_group("fix part of the layout (searched otherwise)")
    for flag in ("dp", "tp", "pp", "micro-batch"):
        fixed.add_argument(f"--{flag}", type=int, default=None)
    fixed.add_argument("--cp", type=int, default=None, help="context-parallel size (priced, not searched)")
    fixed.add_argument("--ep", type=int, default=None, help="expert-parallel size (searched with --experts)")
    fixed.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None)
    fixed.add_argument("--schedule", choices=SCHEDULES, default=None)
    fixed.add_argument("--recompute", choices=RECOMPUTE, default=None)
    out = parser.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="layouts in the ranking (default %(default)s)")
    out.add_argument("--json", default=None, metavar="FILE|-", help="write the plan as JSON ('-': stdout)")
    out.add_argument("--plot", default=None, metavar="FILE", help="memory bars and predicted scaling")
    out.add_argument(
        "--validate",
        type=int,
        default=None,
        metavar="K",
        help="run the top K layouts that fit this machine (gpt-nano/gpt-tiny scale) and compare",
    )
    out.add_argument("--steps", type=int, default=6, help="steps per --validate run (default %(default)s)")
    parser.set_defaults(func=handler)


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """The model of the flags, with --experts / --top-k making its MLPs a mixture of experts."""
    from dataclasses import replace

    spec = _dense_spec(args)
    if args.experts is None and args.top_k is None:
        return spec
    if args.params is not None:
        raise ValueError("--experts needs a shape (--config or --layers --hidden --heads), not --params")
    config = spec.config
    experts = config.experts if args.experts is None else args.experts
    if not experts:
        raise ValueError("--top-k needs a mixture of experts: give --experts E")
    return ModelSpec.of(replace(config, experts=experts, top_k=args.top_k or config.top_k))


def _dense_spec(args: argparse.Namespace) -> ModelSpec:
    from meshwise.models.gpt_shape import GPTConfig, gpt_config

    sizes = {
        "layers": args.layers,
        "hidden": args.hidden,
        "heads": args.heads,
        "vocab": args.vocab,
        "seq_len": args.seq_len,
    }
    if args.params is not None:
        if args.config is not None or args.layers or args.hidden:
            raise ValueError("give --params or a shape (--config / --layers --hidden), not both")
        return ModelSpec.from_parameters(
            args.params, seq_len=args.seq_len, vocab=args.vocab, heads=args.heads
        )
    if args.config is None:
        missing = [f"--{k.replace('_', '-')}" for k in ("layers", "hidden", "heads") if sizes[k] is None]
        if missing:
            raise ValueError(f"give --config NAME, --params N, or a shape: missing {' '.join(missing)}")
        return ModelSpec.of(
            GPTConfig(
                sizes["layers"],
                sizes["hidden"],
                sizes["heads"],
                sizes["seq_len"] or 2048,
                sizes["vocab"] or 50257,
            )
        )
    if args.gpu == "cpu" and sizes["seq_len"] is None:  # train gpt's default context on a CPU
        from meshwise.train.gpt.config import CPU_SEQ_LEN

        sizes["seq_len"] = min(gpt_config(args.config).seq_len, CPU_SEQ_LEN)
    return ModelSpec.of(gpt_config(args.config, **sizes))


def problem_of(args: argparse.Namespace) -> Problem:
    if args.gpus < 1:
        raise ValueError(f"--gpus must be at least 1, got {args.gpus}")
    model = model_spec(args)
    dtype = args.dtype or ("fp32" if args.gpu == "cpu" else "bf16")
    machine = hardware(args.gpu) if args.gpu != "cpu" else measure_cpu(args.gpus, model.config)
    if args.calibrate and args.gpu != "cpu":
        from meshwise.plan.hardware import calibrated

        machine = calibrated(machine)
    machine = with_overrides(
        machine,
        tflops=args.peak_tflops,
        dtype=dtype,
        memory_gb=args.memory_gb,
        intra_gbs=args.intra_gbs,
        inter_gbs=args.inter_gbs,
        intra_us=args.intra_us,
        inter_us=args.inter_us,
        per_node=args.gpus_per_node,
    )
    batch = args.global_batch or (8 if args.gpu == "cpu" else 1024)
    if batch < 1:
        raise ValueError(f"--global-batch must be at least 1, got {batch}")
    # the CPU's SDPA without dropout and the GPUs' flash kernels save no s×s scores
    return Problem(model, machine, Precision(dtype, args.optimizer), batch, args.gpus)


def fixed_of(args: argparse.Namespace, problem: Problem) -> dict[str, object]:
    """The fixed dimensions, checked: a fixed mesh that cannot run the model fails in one line here."""
    fixed = {k: getattr(args, k) for k in FIXED if getattr(args, k) is not None}
    known = 1
    for k in AXES:
        if int(fixed.get(k, 1)) < 1:  # type: ignore[call-overload]
            raise ValueError(f"--{k} must be at least 1, got {fixed[k]}")
        known *= int(fixed.get(k, 1))  # type: ignore[call-overload]
    if problem.gpus % known:
        mesh = " × ".join(f"{k} {fixed[k]}" for k in AXES if k in fixed)
        raise ValueError(
            f"{mesh} does not divide --gpus {problem.gpus}: choose sizes whose product divides it"
        )
    if {"cp", "ep"} & fixed.keys() or sum(k in fixed for k in ("dp", "tp", "pp")) >= 2:
        check(representative(fixed, problem.gpus), problem.model.config, problem.gpus, problem.global_batch)
    return fixed


def representative(fixed: dict[str, object], gpus: int) -> Layout:
    """The simplest layout honouring ``fixed``: the GPUs not fixed go to the first free mesh axis."""
    sizes = {k: fixed[k] for k in AXES if k in fixed}
    rest = gpus // max(1, math.prod(int(v) for v in sizes.values()))  # type: ignore[call-overload]
    for k in ("dp", "tp", "pp"):
        if k not in sizes:
            sizes[k], rest = rest, 1
    schedule = str(fixed.get("schedule", "1f1b"))
    return Layout(
        int(sizes["dp"]), int(sizes["tp"]), int(sizes["pp"]), int(fixed.get("zero", 0)),
        int(fixed.get("micro_batch", 1)), schedule, 2 if schedule == "interleaved" else 1,
        str(fixed.get("recompute", "none")), int(sizes["tp"]) > 1, int(fixed.get("cp", 1)),
        int(fixed.get("ep", 1)),
    )  # fmt: skip


def handler(args: argparse.Namespace) -> int:
    try:
        check_output("--json", args.json)
        check_plot("--plot", args.plot)
        if args.validate is not None:
            from meshwise.cli.plan_validate import check_validatable

            if args.validate < 1 or args.steps < 2:
                raise ValueError("--validate K needs K ≥ 1 and --steps ≥ 2 (the first step is warm-up)")
            check_validatable(args.gpu, args.config)
        problem = problem_of(args)
        fixed = fixed_of(args, problem)
        plan = advise(problem, fixed)
        if plan.best is None:  # say why the simplest layout honouring the flags cannot run, if it cannot
            check(
                representative(fixed, problem.gpus), problem.model.config, problem.gpus, problem.global_batch
            )
            raise ValueError(
                "no layout of these GPUs satisfies the fixed flags and the model's sizes: "
                "relax --tp/--pp/--dp/--cp/--ep/--micro-batch or change --gpus"
            )
    except ValueError as exc:
        print(f"meshwise plan: error: {exc}", file=sys.stderr)
        return 2
    tokens = args.tokens or 20 * problem.model.parameters
    if args.json != "-":
        print(render(plan, tokens, args.top))
    data = to_json(plan, tokens)
    if args.validate:
        from meshwise.cli.plan_validate import validate

        try:
            data["validation"] = validate(plan, args.config, args.validate, args.steps)
        except ValueError as exc:
            print(f"meshwise plan: error: {exc}", file=sys.stderr)
            return 2
    writers = []
    if args.json == "-":
        print(json.dumps(data, indent=2))
    elif args.json:
        writers.append(
            ("JSON", args.json, lambda: Path(args.json).write_text(json.dumps(data, indent=2) + "\n"))
        )
    if args.plot:
        writers.append(("plot", args.plot, lambda: plot(plan, _scaling(problem, fixed), args.plot)))
    ok = write_outputs("plan", writers)
    return 0 if ok and plan.best.fits else 1


def _scaling(problem: Problem, fixed: dict[str, object]) -> list[tuple[int, float | None]]:
    """Best predicted tokens/s from 1/8 to 2× the GPUs (the batch kept), for the scaling plot."""
    from dataclasses import replace

    points = []
    for factor in (0.125, 0.25, 0.5, 1, 2):
        gpus = max(1, int(problem.gpus * factor))
        best = advise(replace(problem, gpus=gpus), {k: v for k, v in fixed.items() if k not in ("dp",)}).best
        points.append((gpus, best.time.tokens_per_second if best and best.fits else None))
    return points
