"""``meshwise train gpt --auto``: plan the layouts of the given ranks, try the top three for a few steps,
and train with the one that was fastest (a plan ranks by prediction; a short trial settles it)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from meshwise.cli.plan_validate import measure, trial_layout
from meshwise.plan import ModelSpec, Precision, Problem, advise
from meshwise.plan.hardware import measure_cpu

TRIALS = 3
TRIAL_STEPS = 3


def choose_layout(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the mesh, ZeRO stage, micro-batch and schedule of the fastest trial (ValueError: one
    line, when no layout fits or none of the tries ran)."""
    from meshwise.models.gpt import gpt_config
    from meshwise.train.gpt.config import CPU_SEQ_LEN, DEFAULT_MODEL

    if args.device == "cuda":
        raise ValueError("--auto plans with the measured cpu preset; on a GPU use meshwise plan --gpu PRESET")
    name = args.config or DEFAULT_MODEL
    sizes = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab")}
    config = gpt_config(name, **sizes)
    config = gpt_config(name, **sizes, seq_len=args.seq_len or min(config.seq_len, CPU_SEQ_LEN))
    ranks = args.nproc or 1
    problem = Problem(
        ModelSpec.of(config), measure_cpu(ranks, config), Precision(args.dtype), args.global_batch, ranks
    )
    plan = advise(problem, {"recompute": "none"})
    if plan.best is None or not plan.best.fits:
        raise ValueError(f"--auto: no layout of {ranks} ranks fits this model here; lower --global-batch")
    with tempfile.TemporaryDirectory(prefix="meshwise-auto-") as scratch:
        tried = measure(plan, name, TRIALS, TRIAL_STEPS, Path(scratch))
    if not tried:
        raise ValueError("--auto: none of the planned layouts ran; pass --dp/--tp/--pp yourself")
    print("meshwise train gpt --auto: tried")
    for candidate, result in tried:
        print(
            f"  {candidate.layout.name():<32} predicted {candidate.time.step:8.3f} s/step, measured "
            f"{result.step_time:8.3f} s/step"
        )
    candidate, _ = min(tried, key=lambda pair: pair[1].step_time)
    print(f"  training with {candidate.layout.name()}", flush=True)
    chosen = trial_layout(candidate.layout)
    updates = {
        "dp": None,
        "tp": 1,
        "pp": 1,
        "zero": 0,
        "micro_batch": None,
        "micro_batches": None,
        "sp": False,
    }
    updates |= chosen
    return argparse.Namespace(**(vars(args) | {"seq_len": config.seq_len} | updates))


def run_auto(args: argparse.Namespace, train: Callable[[argparse.Namespace], int]) -> int:
    """Choose the layout, then ``train`` with it; a failure to choose is one line and exit code 2."""
    try:
        chosen = choose_layout(args)
    except ValueError as exc:
        print(f"meshwise train gpt: error: {exc}", file=sys.stderr)
        return 2
    return train(argparse.Namespace(**(vars(chosen) | {"auto": False})))
