"""``meshwise plan --validate K``: run the plan's top K layouts on this machine and score the plan.

Each candidate becomes a ``meshwise train gpt`` trial (:mod:`meshwise.train.trial`) of a few steps on
this host's ranks; the predicted step time and per-rank memory are set against the measured median step
and the trial's peak resident memory above a baseline trial (what the runtime costs before any model).
Candidates the trainer refuses (a combination it does not support yet) are reported and skipped.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from meshwise.models.gpt import GPTConfig
from meshwise.plan import Candidate, Layout, Plan
from meshwise.plan.accuracy import mape, regret, spearman
from meshwise.train.trial import TrialResult, TrialSpec, run_trial

#: peaks smaller than this are dominated by what any step allocates besides the model (autograd's graph,
#: Python objects, gloo's buffers: ~1 MiB): gpt-tiny's whole model state is ~3.5 MB, so its memory error
#: is shown but not scored; gpt-nano's is (benchmarks/bench_plan.py)
MEMORY_RESOLUTION = 16 * 2**20


def check_validatable(gpu: str, config: str | None) -> None:
    """--validate runs here: the cpu preset and a named config the trainer can build."""
    if gpu != "cpu" or config is None:
        raise ValueError(
            "--validate runs the candidates on this machine: use --gpu cpu and --config NAME "
            "(e.g. gpt-tiny or gpt-nano) with --gpus at most the local cores"
        )


def trial_layout(layout: Layout) -> dict[str, int | str | bool]:
    """The train gpt flags of a planned layout."""
    flags: dict[str, int | str | bool] = {
        "dp": layout.dp,
        "tp": layout.tp,
        "pp": layout.pp,
        "micro_batch": layout.micro_batch,
    }
    if layout.zero:
        flags["zero"] = layout.zero
    if layout.sp:
        flags["sp"] = True
    if layout.cp > 1:
        flags["cp"] = layout.cp
    if layout.ep > 1:
        flags["ep"] = layout.ep
    if layout.recompute != "none":
        flags["recompute"] = layout.recompute
    if layout.pp > 1:
        flags["schedule"] = layout.schedule
        if layout.virtual > 1:
            flags["virtual_stages"] = layout.virtual
    return flags


def model_flags(config: GPTConfig) -> tuple[str, ...]:
    """The train gpt flags that make the named config the planned model (its mixture of experts)."""
    return ("--experts", str(config.experts), "--top-k", str(config.top_k)) if config.experts else ()


def measure(
    plan: Plan, config: str, k: int, steps: int, workdir: Path
) -> list[tuple[Candidate, TrialResult]]:
    """Run candidates in ranked order until ``k`` ran (refused ones are reported on stderr and skipped)."""
    problem = plan.problem
    done: list[tuple[Candidate, TrialResult]] = []
    for candidate in plan.ranked:
        if len(done) == k:
            break
        spec = TrialSpec(
            problem.gpus,
            trial_layout(candidate.layout),
            config=config,
            steps=steps,
            global_batch=problem.global_batch,
            seq_len=problem.model.config.seq_len,
            threads=problem.hardware.threads or None,  # as the cpu preset was measured
            model_flags=model_flags(problem.model.config),
        )
        print(f"# validate: {candidate.layout.name()} ...", file=sys.stderr, flush=True)
        result = run_trial(spec, workdir)
        if result.ok:
            done.append((candidate, result))
        else:
            print(f"#   skipped, the trainer said: {result.error}", file=sys.stderr, flush=True)
    return done


def score(rows: list[tuple[Candidate, TrialResult]]) -> dict:
    """Per candidate predicted vs measured, and the plan's errors over them."""
    table = []
    for candidate, result in rows:
        table.append(
            {
                "layout": candidate.layout.name(),
                "predicted_step": candidate.time.step,
                "measured_step": result.step_time,
                "predicted_memory": candidate.memory.total - candidate.memory.reserved,
                "measured_memory": result.peak_allocated,
                "measured_resident": result.peak_resident,
            }
        )
    if not table:
        return {"candidates": [], "error": "no candidate ran"}
    column = lambda key: [row[key] for row in table]  # noqa: E731
    sized = [row for row in table if row["measured_memory"] >= MEMORY_RESOLUTION]
    return {
        "candidates": table,
        "step_mape": mape(column("predicted_step"), column("measured_step")),
        "memory_mape": mape([r["predicted_memory"] for r in sized], [r["measured_memory"] for r in sized])
        if sized
        else None,
        "rank_correlation": spearman(column("predicted_step"), column("measured_step")),
        "regret": regret(column("predicted_step"), column("measured_step")),
    }


def render(scored: dict) -> str:
    if not scored["candidates"]:
        return "validation: no candidate ran"
    lines = ["", f"{'layout':<34}{'step pred':>10}{'meas':>9}{'err':>7}{'MiB pred':>10}{'meas':>9}{'err':>7}"]
    for row in scored["candidates"]:
        ps, ms = row["predicted_step"], row["measured_step"]
        pm, mm = row["predicted_memory"] / 2**20, row["measured_memory"] / 2**20
        error = f"{100 * (pm / mm - 1):>+6.0f}%" if row["measured_memory"] >= MEMORY_RESOLUTION else "    n/a"
        step = f"{ps:>10.3f}{ms:>9.3f}{100 * (ps / ms - 1):>+6.0f}%"
        lines.append(f"{row['layout']:<34}{step}{pm:>10.1f}{mm:>9.1f}{error}")
    memory = scored["memory_mape"]
    lines.append(
        f"step time MAPE {100 * scored['step_mape']:.1f} %, memory MAPE "
        f"{'n/a (peaks below 16 MiB are not scored)' if memory is None else f'{100 * memory:.1f} %'}, "
        f"rank correlation {scored['rank_correlation']:.2f}, regret {scored['regret']:.2f} "
        "(memory: the fullest rank's peak allocated bytes during the steps, above those before the model)"
    )
    return "\n".join(lines)


def validate(plan: Plan, config: str, k: int, steps: int) -> dict:
    """Run, score and print; the scored dict for --json."""
    with tempfile.TemporaryDirectory(prefix="meshwise-validate-") as scratch:
        scored = score(measure(plan, config, k, steps, Path(scratch)))
    print(render(scored), flush=True)
    return scored
