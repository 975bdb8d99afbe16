"""Every layout ``meshwise train gpt`` composes, on gpt-nano and 4 ranks: step time and per-rank peak memory.

For each layout the same 4 CPU ranks (gloo) run the real trainer — what ``meshwise train gpt -np 4
<flags>`` runs — for ``--steps`` steps on the same tokens (the standard library's ``argparse.py``) from
the same seed. A step's time is the trainer's own (the slowest rank's, as the loop reports it), the
median over the steps after the first. Per-rank peak memory, the largest over the ranks, twice: the peak
*allocated* bytes during the steps (the trainer's own figure, its ``--json`` ``peak_memory.allocated``:
tensors held, measured above the bytes torch takes for itself — what ``meshwise plan`` predicts), and the
growth of the resident set's high-water mark (VmHWM) from before the model is built to the end (which
also holds the whole model built on every rank before it is cut, and what glibc keeps of freed
activations). Layouts run one after another, so compare figures taken in one run only (the machine's
load is printed with them).

    python benchmarks/bench_layouts.py --json benchmarks/results/c25_layouts.json --markdown table.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sysconfig
from pathlib import Path

import meshwise
from meshwise.runtime.memory import peak_resident_bytes
from meshwise.runtime.spawn import spawn
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.loop import GPTTrainer
from meshwise.train.gpt.resolve import GPTRun, resolve

#: layout → the flags of `meshwise train gpt -np 4`
LAYOUTS: dict[str, dict] = {  # gpt-nano has 6 heads: tp splits them 2 (or 3) ways, never 4
    "dp4": {},
    "dp2·tp2": {"tp": 2},
    "dp2·tp2·sp": {"tp": 2, "sp": True},
    "pp4": {"pp": 4},
    "pp2·dp2": {"pp": 2},
    "pp2·tp2": {"pp": 2, "tp": 2},
    "pp2·tp2 interleaved": {"pp": 2, "tp": 2, "schedule": "interleaved", "virtual_stages": 3},
    "zero1×4": {"zero": 1},
    "zero3×4": {"zero": 3},
    "zero3·tp2": {"zero": 3, "tp": 2},
    "zero1·tp2·sp": {"zero": 1, "tp": 2, "sp": True},
    "zero2·pp2": {"zero": 2, "pp": 2},
    "zero3·pp2": {"zero": 3, "pp": 2},
    "pp2·dp2 zb": {"pp": 2, "schedule": "zb"},
    "cp2·dp2": {"cp": 2},
    "ep2·dp2 moe": {"ep": 2, "experts": 4, "top_k": 2},  # 4 experts, top-2
}


def _flags(flags: dict) -> str:
    words = [f"-np {flags.get('nproc', 4)}"]
    for key, value in flags.items():
        if key == "nproc":
            continue
        flag = "--" + key.replace("_", "-")
        words.append(flag if value is True else f"{flag} {value}")
    return " ".join(words)


def _run(run: GPTRun) -> dict:
    world = meshwise.init("gloo", timeout=600, mesh=run.shape)
    try:
        before = peak_resident_bytes() or 0
        trainer = GPTTrainer(world, run)
        seconds = [trainer.train_step(step).seconds for step in range(run.config.optimizer.steps)]
        allocated = trainer.memory.stop()["allocated"]  # this rank's, above torch's own
        return {"seconds": seconds, "peak_rss_growth": (peak_resident_bytes() or 0) - before,
                "peak_allocated": allocated}  # fmt: skip
    finally:
        meshwise.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per layout (the first is not timed)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated layout names")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--markdown", metavar="FILE", help="also write the table as Markdown")
    args = parser.parse_args()
    data = str(Path(sysconfig.get_paths()["stdlib"]) / "argparse.py")
    rows = {}
    for name in args.layouts.split(","):
        flags = LAYOUTS[name]
        settings = {"config": "gpt-nano", "data": data, "seq_len": 128, "global_batch": 8,
                    "steps": args.steps, "warmup": 1, "backend": "gloo", "nproc": 4}  # fmt: skip
        run = resolve(GPTTrainConfig.from_flags(**(settings | flags)))
        results = spawn(_run, run.world_size, args=(run,), timeout=1200)
        rows[name] = {
            "command": f"meshwise train gpt {_flags({'nproc': 4} | flags)} --seq-len 128 --global-batch 8",
            "step_seconds": statistics.median(results[0]["seconds"][1:]),
            "peak_rss_growth_mib": max(r["peak_rss_growth"] for r in results) / 2**20,
            "peak_allocated_mib": max(r["peak_allocated"] or 0 for r in results) / 2**20,
            "load": os.getloadavg()[0],
        }
        row = rows[name]
        print(f"{name:26} {row['step_seconds']:8.3f} s  {row['peak_allocated_mib']:7.1f} MiB allocated  "
              f"{row['peak_rss_growth_mib']:7.1f} MiB RSS  "
              f"load {row['load']:.1f}   {row['command']}", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.markdown:
        lines = ["| layout | command | step s (median) | peak allocated / rank, MiB | "
                 "peak RSS growth / rank, MiB | load |", "|---|---|---:|---:|---:|---:|"]  # fmt: skip
        lines += [f"| {n} | `{r['command']}` | {r['step_seconds']:.3f} | {r['peak_allocated_mib']:.1f} | "
                  f"{r['peak_rss_growth_mib']:.1f} | {r['load']:.1f} |" for n, r in rows.items()]  # fmt: skip
        Path(args.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
