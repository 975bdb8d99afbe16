"""``train gpt --compile``: tokens/s with and without torch.compile, side by side (issue 30).

gpt-nano on byte tokens of the stdlib's argparse.py, 1 and 2 ranks (gloo), the same run with and
without ``--compile``, alternating so that both see the same machine. Throughput is the median over the
steps after the first ``--skip`` (compilation happens in the first step of each rank); the compile time
is the first step's excess over the median. On a CPU, torch.compile needs a C++ compiler (inductor
generates C++/OpenMP kernels).

    python benchmarks/bench_compile.py --json benchmarks/results/u30_compile.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sysconfig
from pathlib import Path

from meshwise.train.gpt import GPTTrainConfig, run_gpt_training


def one_run(ranks: int, compiled: bool, steps: int, skip: int) -> dict:
    data = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
    config = GPTTrainConfig.from_flags(
        nproc=ranks, config="gpt-nano", data=str(data), steps=steps, global_batch=8, seq_len=128,
        eval_every=steps, eval_windows=8, backend="gloo", compile=compiled,
    )  # fmt: skip
    result = run_gpt_training(config)
    assert result is not None
    seconds = [s.seconds for s in result.history]
    median = statistics.median(seconds[skip:])
    return {
        "ranks": ranks,
        "compile": compiled,
        "tokens_per_second": result.global_batch * result.seq_len / median,
        "median_step_seconds": median,
        "first_step_excess_seconds": seconds[0] - median,
        "final_loss": result.history[-1].loss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip", type=int, default=2)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for ranks in args.ranks:
        for compiled in (False, True):
            rows.append(one_run(ranks, compiled, args.steps, args.skip) | {"load_1min": os.getloadavg()[0]})
    print(f"{'ranks':>5}{'compile':>9}{'tokens/s':>11}{'step ms':>10}{'compile s':>11}{'loss':>9}{'load':>7}")
    for r in rows:
        print(
            f"{r['ranks']:>5}{r['compile']!s:>9}{r['tokens_per_second']:>11,.0f}"
            f"{1e3 * r['median_step_seconds']:>10.1f}{r['first_step_excess_seconds']:>11.1f}"
            f"{r['final_loss']:>9.4f}{r['load_1min']:>7.1f}"
        )
    for ranks in args.ranks:
        plain, fast = (
            next(r for r in rows if r["ranks"] == ranks and r["compile"] is c) for c in (False, True)
        )
        ratio = fast["tokens_per_second"] / plain["tokens_per_second"]
        print(f"{ranks} rank(s): --compile / plain = {ratio:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, **vars(args)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
