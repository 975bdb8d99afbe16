"""How fast ``meshwise plan`` answers, and how well it predicts this machine.

**Speed.** The full layout search for a 1T-parameter GPT (Narayanan et al.'s 128 layers × 25600) on 3072
A100-80GB: the advisor alone (median of ``--repeat`` calls in this process) and the whole command
(``python -m meshwise plan --params 1e12 --gpus 3072``, interpreter and torch import included).

**Accuracy.** Each layout of ``LAYOUTS`` (gpt-nano by default, 1–4 ranks: dp, tp, sp, pp with GPipe
and 1F1B, ZeRO 1–3, micro-batches, selective and full recomputation, context parallelism) is planned
with the ``cpu`` preset measured once per round for its number of ranks and run as a ``meshwise
train gpt`` trial of ``--steps`` steps (:mod:`meshwise.train.trial`). Reported per layout: predicted vs
measured step time (median after the first step) and per-rank peak memory (the fullest rank's peak
allocated bytes during the steps above those before its model was built, which the run measures itself;
its resident high-water mark above the same point is shown beside it); and over all of them: the mean
absolute percentage errors, Spearman's rank correlation of the step times and the regret (measured time
of the predicted-fastest over the fastest measured); with ``--rounds N`` every layout runs N times,
one pass over all of them per round, and each figure is the median of its rounds. Targets (issue 27):
each memory error ≤ 10 %, mean step-time error ≤ 20 %, rank correlation ≥ 0.8.

    python benchmarks/bench_plan.py --rounds 2 --json benchmarks/results/plan_rank.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from meshwise.cli.plan_validate import trial_layout
from meshwise.models.gpt import gpt_config
from meshwise.plan import Layout, ModelSpec, Precision, Problem, advise, hardware
from meshwise.plan.accuracy import mape, regret, spearman
from meshwise.plan.hardware import measure_cpu
from meshwise.train.trial import TrialSpec, run_trial

#: (ranks, planner layout): dp, tp (± sp), pp (GPipe, 1F1B), ZeRO 1–3, micro-batches, cp, combinations
LAYOUTS: list[Layout] = [
    Layout(1, 1, 1, micro_batch=8),
    Layout(1, 1, 1, micro_batch=4),
    Layout(2, 1, 1, micro_batch=4),
    Layout(2, 1, 1, zero=1, micro_batch=4),
    Layout(2, 1, 1, zero=2, micro_batch=4),
    Layout(2, 1, 1, zero=3, micro_batch=4),
    Layout(1, 2, 1, micro_batch=8),
    Layout(1, 2, 1, micro_batch=8, sp=True),
    Layout(1, 1, 2, micro_batch=2, schedule="1f1b"),
    Layout(1, 1, 2, micro_batch=2, schedule="gpipe"),
    Layout(4, 1, 1, micro_batch=2),
    Layout(2, 2, 1, micro_batch=4),
    Layout(2, 1, 2, micro_batch=2),
    Layout(2, 1, 1, micro_batch=4, recompute="selective"),
    Layout(2, 1, 1, micro_batch=4, recompute="full"),
    Layout(1, 1, 1, micro_batch=8, cp=2),
]
TARGETS = {"memory_error_each": 0.10, "step_mape": 0.20, "rank_correlation": 0.8}


def speed(repeat: int) -> dict:
    """Wall and CPU seconds (medians): on a host shared with other jobs the CPU time is what the planner
    costs, the wall time what it took while waiting for cores."""
    problem = Problem(ModelSpec.from_parameters(1e12), hardware("a100-80gb"), Precision(), 3072, 3072)
    advisor, advisor_cpu, command, command_cpu = [], [], [], []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        plan = advise(problem)
        advisor.append(time.perf_counter() - wall)
        advisor_cpu.append(time.process_time() - cpu)
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        wall = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "meshwise", "plan", "--params", "1e12", "--gpus", "3072"],
            check=True,
            capture_output=True,
        )
        command.append(time.perf_counter() - wall)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        command_cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return {
        "layouts_priced": len(plan.ranked) + plan.rejected,
        "best": plan.best.layout.name(),
        "advisor_seconds": statistics.median(advisor),
        "advisor_cpu_seconds": statistics.median(advisor_cpu),
        "command_seconds": statistics.median(command),
        "command_cpu_seconds": statistics.median(command_cpu),
    }


def accuracy(
    config: str, steps: int, global_batch: int, seq_len: int, layouts: list[Layout], rounds: int = 1
) -> dict:
    """Every layout run ``rounds`` times, a round being one pass over all of them (so a busy spell of the
    host lands on every layout rather than on a few); per layout the median of its rounds' predictions
    (the ``cpu`` preset re-measured per round and rank count) and of its measured steps."""
    model = ModelSpec.of(gpt_config(config, seq_len=seq_len))
    runs: dict[Layout, list[dict]] = {layout: [] for layout in layouts}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as scratch:
        work = Path(scratch)
        for round_index in range(rounds):
            # one measurement per rank count and round, so that layouts of as many ranks are ordered by
            # the model alone (re-measured per layout, a busy host's noise moved equal work 2-5x)
            machines: dict = {}
            for layout in layouts:
                ranks = layout.gpus
                if ranks not in machines:
                    machines[ranks] = measure_cpu(ranks, model.config)
                machine = machines[ranks]
                candidate = Problem(model, machine, Precision("fp32"), global_batch, ranks).price(layout)
                spec = TrialSpec(
                    ranks,
                    trial_layout(layout),
                    config=config,
                    steps=steps,
                    global_batch=global_batch,
                    seq_len=seq_len,
                    threads=machine.threads,  # as the preset was measured (see hardware.rank_threads)
                )
                result = run_trial(spec, work, timeout=600)
                run = {"round": round_index, "ok": result.ok, "error": result.error}
                run |= {"predicted_step": candidate.time.step, "causes": candidate.time.causes()}
                run |= {"predicted_memory": candidate.memory.total}
                if result.ok:
                    run |= {
                        "measured_step": result.step_time,
                        "step_seconds": list(result.step_seconds),
                        "measured_memory": result.peak_allocated,
                        "measured_resident": result.peak_resident,
                        "setup_allocated": result.setup_allocated,
                    }
                runs[layout].append(run)
                print(f"round {round_index + 1}/{rounds} " + _line(layout.name(), run), flush=True)
    rows = [_summary(layout, runs[layout]) for layout in layouts]
    ran = [r for r in rows if r["ok"]]
    predicted, measured = [r["predicted_step"] for r in ran], [r["measured_step"] for r in ran]
    print("per layout, median of the rounds:")
    for row in rows:
        print("  " + _line(row["layout"], row))
    return {
        "config": config,
        "steps": steps,
        "global_batch": global_batch,
        "seq_len": seq_len,
        "rounds": rounds,
        "load_average": {"start": load_before, "end": os.getloadavg()},  # 1, 5, 15 minutes
        "rows": rows,
        "step_mape": mape(predicted, measured),
        "memory_mape": mape([r["predicted_memory"] for r in ran], [r["measured_memory"] for r in ran]),
        "max_memory_error": max(abs(r["memory_error"]) for r in ran),
        "rank_correlation": spearman(predicted, measured),
        "regret": regret(predicted, measured),
    }


def reprice(recorded: dict[str, dict], layouts: list[Layout], rounds: int = 1) -> dict:
    """The layouts of recorded accuracy runs (same model, batch and sequence) priced again against each
    run's measured steps, without running the trials: by the model as it is now (``now``, the ``cpu``
    preset measured live once per rank count and round, the median of the rounds) and by the same live
    presets without the tp shards' curves, the groups' meetings and the cores' share in the bubble
    (``base``: the model before them), so that their effect is seen apart from the host's load now,
    which moves both alike; ``was`` is what each recorded run predicted. Besides the MAPE and rank
    correlation, the MAPE of each layout's step relative to the first layout of its rank count
    (:func:`_relative`), which the load at each rank count's measurement does not move."""
    first = next(iter(recorded.values()))["accuracy"]
    shape = (first["config"], first["global_batch"], first["seq_len"])
    for name, run in recorded.items():
        acc = run["accuracy"]
        if (acc["config"], acc["global_batch"], acc["seq_len"]) != shape:
            raise ValueError(f"{name}: not the model, batch and sequence of the first run; reprice it alone")
    model = ModelSpec.of(gpt_config(shape[0], seq_len=shape[2]))
    names = {row["layout"] for run in recorded.values() for row in run["accuracy"]["rows"]}
    wanted = [layout for layout in layouts if layout.name() in names]
    priced: dict[str, dict[str, list[float]]] = {layout.name(): {"base": [], "now": []} for layout in wanted}
    load = [os.getloadavg()]
    for _ in range(rounds):
        machines: dict = {}
        for layout in wanted:
            if layout.gpus not in machines:
                now = measure_cpu(layout.gpus, model.config)
                machines[layout.gpus] = {"base": replace(now, shard_efficiency={}, rendezvous={}, share=1.0)}
                machines[layout.gpus]["now"] = now
            for key, hw in machines[layout.gpus].items():
                problem = Problem(model, hw, Precision("fp32"), shape[1], layout.gpus)
                priced[layout.name()][key].append(problem.price(layout).time.step)
    load.append(os.getloadavg())
    steps = {name: {key: statistics.median(v) for key, v in by.items()} for name, by in priced.items()}
    result: dict = {"load_average": load, "predicted": steps, "runs": {}}
    for run_name, run in recorded.items():
        rows = [r for r in run["accuracy"]["rows"] if r["ok"] and r["layout"] in steps]
        measured = [r["measured_step"] for r in rows]
        print(f"{run_name}:")
        for r in rows:
            now = steps[r["layout"]]
            print(
                f"  {r['layout']:<30} was {r['predicted_step']:6.3f}  base {now['base']:6.3f}  now "
                f"{now['now']:6.3f}  measured {r['measured_step']:6.3f} s"
            )
        figures = {}
        for key in ("was", "base", "now"):
            predicted = [r["predicted_step"] if key == "was" else steps[r["layout"]][key] for r in rows]
            figures[key] = {
                "step_mape": mape(predicted, measured),
                "rank_correlation": spearman(predicted, measured),
                "relative_mape": mape(*_relative(rows, predicted, measured)),
            }
            print(
                f"  {key:<5} step-time MAPE {100 * figures[key]['step_mape']:5.1f} %, rank correlation "
                f"{figures[key]['rank_correlation']:.2f}, relative MAPE "
                f"{100 * figures[key]['relative_mape']:5.1f} %"
            )
        result["runs"][run_name] = figures
    return result


def _relative(
    rows: list[dict], predicted: list[float], measured: list[float]
) -> tuple[list[float], list[float]]:
    """Each layout's step over that of the first layout of as many ranks (predicted, measured), that one
    left out: layouts of one rank count share one live measurement of the host, so these ratios hold
    whatever the load was when it was taken, which moves the levels of the rank counts apart."""
    first: dict[int, int] = {}
    ratios: tuple[list[float], list[float]] = ([], [])
    for i, row in enumerate(rows):
        ref = first.setdefault(row["ranks"], i)
        if ref != i:
            ratios[0].append(predicted[i] / predicted[ref])
            ratios[1].append(measured[i] / measured[ref])
    return ratios


def _summary(layout: Layout, runs: list[dict]) -> dict:
    """One layout over its rounds: medians of what ran, every round kept."""
    done = [r for r in runs if r["ok"]]
    row = {"layout": layout.name(), "ranks": layout.gpus, "ok": bool(done), "rounds": runs}
    row["error"] = "" if done else runs[-1]["error"]
    row["predicted_step"] = statistics.median(r["predicted_step"] for r in runs)
    row["predicted_memory"] = statistics.median(r["predicted_memory"] for r in runs)
    row["causes"] = {k: statistics.median(r["causes"][k] for r in runs) for k in runs[0]["causes"]}
    if done:
        for key in ("measured_step", "measured_memory", "measured_resident", "setup_allocated"):
            row[key] = statistics.median(r[key] for r in done)
        row["step_error"] = row["predicted_step"] / row["measured_step"] - 1
        row["memory_error"] = row["predicted_memory"] / row["measured_memory"] - 1
    return row


def _line(name: str, row: dict) -> str:
    if not row["ok"]:
        return f"{name:<30} did not run: {row['error']}"
    step_error = row["predicted_step"] / row["measured_step"] - 1
    memory_error = row["predicted_memory"] / row["measured_memory"] - 1
    return (
        f"{name:<30} step {row['predicted_step']:7.3f} / {row['measured_step']:7.3f} s "
        f"({100 * step_error:+5.0f} %)   memory {row['predicted_memory'] / 2**20:7.1f} / "
        f"{row['measured_memory'] / 2**20:7.1f} MiB ({100 * memory_error:+5.1f} %), resident "
        f"{row['measured_resident'] / 2**20:7.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="gpt-nano")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3, help="timings of the planner's speed")
    parser.add_argument("--rounds", type=int, default=1, help="passes over the layouts (medians taken)")
    parser.add_argument("--limit", type=int, default=len(LAYOUTS), help="run the first N layouts only")
    parser.add_argument(
        "--layouts", nargs="+", default=None, metavar="NAME", help="run only layouts whose name contains one"
    )
    parser.add_argument(
        "--reprice",
        nargs="+",
        default=None,
        metavar="JSON",
        help="price recorded runs' layouts again (cpu measured now, --rounds times) against their measured "
        "steps; no trials",
    )
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    layouts = [
        layout
        for layout in LAYOUTS[: args.limit]
        if args.layouts is None or any(part in layout.name() for part in args.layouts)
    ]
    if args.reprice:
        recorded = {name: json.loads(Path(name).read_text()) for name in args.reprice}
        repriced = reprice(recorded, layouts, args.rounds)
        if args.json:
            Path(args.json).write_text(json.dumps(repriced, indent=2) + "\n")
        return
    results: dict = {"speed": speed(args.repeat)}
    fast = results["speed"]
    print(
        f"1T parameters on 3072 GPUs: {fast['layouts_priced']:,} layouts, advisor "
        f"{fast['advisor_seconds']:.2f} s ({fast['advisor_cpu_seconds']:.2f} s CPU), whole command "
        f"{fast['command_seconds']:.2f} s ({fast['command_cpu_seconds']:.2f} s CPU); best {fast['best']}"
    )
    if not args.skip_accuracy:
        acc = accuracy(args.config, args.steps, args.global_batch, args.seq_len, layouts, args.rounds)
        results["accuracy"] = acc
        print(
            f"step-time MAPE {100 * acc['step_mape']:.1f} % (target ≤ 20), memory MAPE "
            f"{100 * acc['memory_mape']:.1f} %, largest memory error {100 * acc['max_memory_error']:.1f} % "
            f"(target ≤ 10 each), rank correlation {acc['rank_correlation']:.2f} (target ≥ 0.8), regret "
            f"{acc['regret']:.2f}; load average {acc['load_average']['start'][0]:.1f} at the start, "
            f"{acc['load_average']['end'][0]:.1f} at the end"
        )
    results["targets"] = TARGETS
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
