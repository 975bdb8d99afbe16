"""pp2·dp2: the data-parallel communication a pipeline step leaves exposed, before and after the reducer.

Before (``--before-src``, e.g. main's ``src`` from before this change): the executor averaged each stage's
gradients over dp with one flat all-reduce after the step's last backward, every byte of it on the step's
critical path. After (this tree): each chunk's gradients go through DataParallel's bucketed reducer,
launched from autograd's hooks during the chunk's last backward and awaited only when the rank's compute
is over (docs/pipeline.md). Each run is ``meshwise train gpt --pp 2`` on 4 ranks (gloo) with ``--profile``:
rank 0 (stage 0, the last to finish a step) reports per step its exposed communication (time blocked in a
collective or a wait outside the pipeline's window — inside it waiting is the bubble), its bubble and the
step time, each the median over the run's steps. The two trees alternate, each round running both in
fresh processes with the same seed, data and config; reported: per tree the median of the runs' medians,
and the median of the per-round ratios after / before.

With ``--ep 2`` and a mixture-of-experts ``--model`` the replicas are ep ranks (pp2·ep2): before the stage
reducers took expert groups, a stage's gradients — dense over ep, experts ÷ ep — were averaged by one flat
all-reduce after the pipeline step; after, by the stage reducers (dense and expert buckets apart).

    python benchmarks/bench_pipeline_dp.py --before-src /work/main/src \\
        --json benchmarks/results/pipeline_dp.json
    python benchmarks/bench_pipeline_dp.py --before-src BEFORE/src --model gpt-moe-nano --ep 2 \\
        --json benchmarks/results/pipeline_ep.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHOWN = ("step", "comm_exposed", "bubble", "backward", "forward", "optimizer")


def _one(data: str, model: str, steps: int, micro_batches: int, schedule: str, ep: int) -> dict:
    """In a child process: one profiled run of whichever meshwise the PYTHONPATH holds."""
    from meshwise.train.gpt import GPTTrainConfig, run_gpt_training

    config = GPTTrainConfig.from_flags(
        config=model, data=data, seq_len=64, global_batch=8 * micro_batches // 2, steps=steps, warmup=1,
        eval_every=steps, eval_windows=2, backend="gloo", nproc=4, pp=2, micro_batches=micro_batches,
        schedule=schedule, profile=True, ep=ep,
    )  # fmt: skip
    result = run_gpt_training(config)
    assert result is not None and result.profile is not None
    return {key: result.profile["median_seconds"][key] for key in SHOWN}  # rank 0's medians over steps


def _spawn(src: str, args: argparse.Namespace, data: str) -> dict:
    env = os.environ | {"PYTHONPATH": src}
    command = [sys.executable, __file__, "--child", data, "--model", args.model, "--steps", str(args.steps)]
    command += ["--micro-batches", str(args.micro_batches), "--schedule", args.schedule, "--ep", str(args.ep)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before-src", help="the src/ directory of the code to compare with (required)")
    parser.add_argument("--after-src", default=str(HERE.parent / "src"), help="default: this tree's src/")
    parser.add_argument("--model", default="gpt-nano", help="named GPT config (default gpt-nano)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (first not timed)")
    parser.add_argument("--micro-batches", type=int, default=4, help="micro-batches per replica")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--ep", type=int, default=1, help="2: the replicas are ep ranks (a MoE --model)")
    parser.add_argument("--rounds", type=int, default=3, help="before/after pairs")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        one = _one(args.child, args.model, args.steps, args.micro_batches, args.schedule, args.ep)
        print(json.dumps(one))
        return
    if args.before_src is None:
        parser.error("--before-src is required: the src/ directory of the code to compare with")
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "argparse.txt")
        Path(data).write_bytes((Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_bytes())
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for round_ in range(args.rounds):
            order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
            for tree in order:
                runs[tree].append(_spawn(getattr(args, f"{tree}_src"), args, data))
    medians = {
        tree: {key: statistics.median(run[key] for run in found) for key in SHOWN}
        for tree, found in runs.items()
    }
    ratios = {
        key: statistics.median(
            a[key] / b[key] for a, b in zip(runs["after"], runs["before"], strict=True) if b[key] > 0
        )
        for key in SHOWN
    }
    layout = f"pp2·{'ep' if args.ep > 1 else 'dp'}2, {args.model}, {args.schedule}, m={args.micro_batches}"
    print(f"{layout}, rank 0 (stage 0), ms per step")
    print(f"{'':<8}" + "".join(f"{key:>14}" for key in SHOWN))
    for tree in ("before", "after"):
        print(f"{tree:<8}" + "".join(f"{1e3 * medians[tree][key]:14.1f}" for key in SHOWN))
    print(f"{'ratio':<8}" + "".join(f"{ratios[key]:14.2f}" for key in SHOWN))
    if args.json:
        summary = {"config": vars(args) | {"child": None}, "runs": runs, "medians": medians, "ratios": ratios}
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
