"""No regression against torch: every strategy's step-time ratio to torch's own, now and at an older revision.

One run measures, on 2 CPU ranks (gloo), the ratio of our step time to torch's for the same model, initial
weights and data — each ratio the median over rounds of per-round ratios, the contenders of a strategy
taking turns within a round (``bench_ddp``'s rotating rounds), a step's time the slowest rank's:

- ``dp/gloo``, ``dp/shm``: DataParallel on gloo / on shared memory vs torch DDP on gloo (bench_ddp's 8 ×
  1024 GELU MLP, batch 64 per rank, SGD);
- ``zero3``: ZeRO-3 (the blocks as units) vs FSDP2 ``fully_shard`` on every block and the root (bench_zero's
  gpt-nano, 2 × 128 tokens per rank, AdamW);
- ``tp``, ``tp+sp``: tensor parallel (and with sequence parallelism) vs DTensor ``parallelize_module`` with
  the Megatron plan (bench_tensor's 4 × 256 GPT, batch 8, AdamW);
- ``pp gpipe``, ``pp 1f1b``: our pipeline executor vs ``torch.distributed.pipelining`` with the same stages,
  m = 4 (bench_pipeline's tiny GPT, 4 sequences per micro-batch, SGD).

``--before REV`` extracts REV's ``src`` (``git archive``) and measures it in the same run: every round runs
the measuring processes once per source tree, the order alternating, so the load the machine has at one
moment hits both; the table prints each ratio now, at REV, and after / before. The last recorded values
(the JSON results the RESULTS.md tables were made from) are printed beside them.

    python benchmarks/bench_no_regression.py --before 92dcec4 --rounds 3 \\
        --json benchmarks/results/noregress.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
REPOSITORY = BENCHMARKS.parent

#: ratio name → (strategy group, our contender, torch's contender); a group's contenders share rounds
RATIOS: dict[str, tuple[str, str, str]] = {
    "dp/gloo vs DDP": ("dp", "meshwise/gloo", "torch/gloo"),
    "dp/shm vs DDP": ("dp", "meshwise/shm", "torch/gloo"),
    "zero3 vs FSDP2": ("zero3", "meshwise/gloo", "fsdp2/gloo"),
    "tp vs DTensor": ("tp", "meshwise/gloo", "dtensor/gloo"),
    "tp+sp vs DTensor": ("tp", "meshwise/gloo+sp", "dtensor/gloo"),
    "pp gpipe m4 vs torch": ("pp-gpipe", "meshwise/gloo", "torch/gloo"),
    "pp 1f1b m4 vs torch": ("pp-1f1b", "meshwise/gloo", "torch/gloo"),
}
#: how far a ratio may move from its earlier value (the issue's bound)
TOLERANCE = 0.03
#: where each ratio was last recorded: results file and how to read the ratio from it
RECORDED: dict[str, tuple[str, Callable[[dict], float]]] = {
    "dp/gloo vs DDP": ("ddp.json", lambda d: d["ratios"]["two_ranks"]["meshwise/gloo"]),
    "dp/shm vs DDP": ("ddp.json", lambda d: d["ratios"]["two_ranks"]["meshwise/shm"]),
    "zero3 vs FSDP2": ("bench_zero_quiet.json", lambda d: d["ratios"]["zero3/gloo"]["ratio"]),
    "tp vs DTensor": ("tensor_quiet.json", lambda d: d["ratios"]["meshwise/gloo"]),
    "tp+sp vs DTensor": ("tensor_quiet.json", lambda d: d["ratios"]["meshwise/gloo+sp"]),
    "pp gpipe m4 vs torch": ("pipeline_quiet.json", lambda d: _pipeline_row(d, "gpipe")),
    "pp 1f1b m4 vs torch": ("pipeline_quiet.json", lambda d: _pipeline_row(d, "1f1b")),
}


def _pipeline_row(result: dict, schedule: str) -> float:
    return next(
        r["ratio_vs_torch"]
        for r in result["rows"]
        if (r["schedule"], r["micro_batches"], r["contender"]) == (schedule, 4, "meshwise/gloo")
    )


def recorded_ratios(results: Path) -> dict[str, float | None]:
    """Each ratio's last recorded value, or None where its results file is missing."""
    out: dict[str, float | None] = {}
    for name, (file, read) in RECORDED.items():
        path = results / file
        out[name] = read(json.loads(path.read_text())) if path.exists() else None
    return out


def paired_ratios(samples: list[dict[str, dict[str, list[float]]]]) -> dict[str, list[list[float]]]:
    """Per ratio, per run, the per-round ratios: ``samples`` holds one dict per run (group → contender →
    seconds per round), divided pairwise, ours by torch's."""
    out = {}
    for name, (group, ours, theirs) in RATIOS.items():
        if group in samples[0]:
            out[name] = [
                [a / b for a, b in zip(run[group][ours], run[group][theirs], strict=True)] for run in samples
            ]
    return out


def median_ratio(per_run: list[list[float]]) -> float:
    """The median over every round of every run."""
    return statistics.median(r for run in per_run for r in run)


# --- measuring (in the ranks; imports the meshwise found on PYTHONPATH, now or at --before) -----------------


def _tensor_parallel(model, comm, sequence_parallel: bool):
    """The GPT's tensor-parallel conversion wherever this meshwise keeps it (it moved beside the model)."""
    try:
        from meshwise.models.gpt_plan import tensor_parallel
    except ImportError:  # before the rebuild (92dcec4): inside parallel/
        from meshwise.parallel.tensor_parallel import tensor_parallel
    return tensor_parallel(model, comm, sequence_parallel=sequence_parallel)


def _pipeline(model, comm, schedule: str, micro_batches: int):
    """Our executor and this rank's chunks, and every chunk for torch's stages, cut the same way."""
    from meshwise.parallel.pipeline_parallel import builder, partition

    try:
        from meshwise.models.gpt_plan import gpt_plan
    except ImportError:  # before the rebuild (92dcec4): the partition knew the GPT itself
        executor, chunks = builder.pipeline_gpt(model, comm, schedule=schedule, micro_batches=micro_batches)
        return executor, chunks, partition(model, 2, 1)
    plan = gpt_plan(model.config)
    executor, chunks = builder.build_pipeline(
        model, plan, comm, schedule=schedule, micro_batches=micro_batches
    )
    return executor, chunks, partition(model, plan, 2, 1)


def _dp_group(world, shm) -> tuple[dict[str, Callable], Callable[[], None]]:
    import torch
    from bench_ddp import _replica, _stepper
    from torch.nn.parallel import DistributedDataParallel

    from meshwise.parallel import DataParallel

    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(world.rank))
    models = {
        "torch/gloo": DistributedDataParallel(_replica(0, world.device)),
        "meshwise/gloo": DataParallel(_replica(0, world.device), world.comm),
        "meshwise/shm": DataParallel(_replica(0, world.device), shm),
    }
    return {name: _stepper(model, 1e-3, x) for name, model in models.items()}, models.clear


def _zero3_group(world, shm) -> tuple[dict[str, Callable], Callable[[], None]]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch_baselines import fully_shard_blocks, language_model_stepper

    from meshwise.models.gpt import CONFIGS, GPT, language_model_loss
    from meshwise.parallel.zero import shard

    def gpt() -> GPT:
        torch.manual_seed(0)
        return GPT(CONFIGS["gpt-nano"])

    model = gpt()
    models = {
        "fsdp2/gloo": fully_shard_blocks(gpt(), init_device_mesh("cpu", (world.world_size,))),
        "meshwise/gloo": shard(model, world.comm, stage=3, units=list(model.blocks)),
    }
    generator = torch.Generator().manual_seed(world.rank)
    tokens = torch.randint(0, CONFIGS["gpt-nano"].vocab, (2, 129), generator=generator)
    steppers = {
        name: language_model_stepper(
            m, torch.optim.AdamW(m.parameters(), lr=1e-4), language_model_loss, tokens
        )
        for name, m in models.items()
    }
    return steppers, models.clear


def _tp_group(world, shm) -> tuple[dict[str, Callable], Callable[[], None]]:
    import copy

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch_baselines import dtensor_tensor_parallel, language_model_stepper

    from meshwise.models.gpt import GPT, GPTConfig, language_model_loss
    from meshwise.parallel.tensor_parallel import vocab_parallel_cross_entropy

    config = GPTConfig(layers=4, hidden=256, heads=8, seq_len=128)
    torch.manual_seed(0)
    reference = GPT(config)

    def parallel_loss(logits, targets):
        return vocab_parallel_cross_entropy(logits, targets, world.comm, vocab=config.vocab)

    mesh = init_device_mesh("cpu", (world.world_size,))
    models = {
        "dtensor/gloo": (dtensor_tensor_parallel(copy.deepcopy(reference), mesh), language_model_loss),
        "meshwise/gloo": (_tensor_parallel(copy.deepcopy(reference), world.comm, False), parallel_loss),
        "meshwise/gloo+sp": (_tensor_parallel(copy.deepcopy(reference), world.comm, True), parallel_loss),
    }
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab, (8, config.seq_len + 1), generator=generator)
    steppers = {
        name: language_model_stepper(m, torch.optim.AdamW(m.parameters(), lr=1e-3), loss, tokens)
        for name, (m, loss) in models.items()
    }
    return steppers, models.clear


def _pp_group(schedule: str) -> Callable:
    def group(world, shm) -> tuple[dict[str, Callable], Callable[[], None]]:
        import torch
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        from torch_baselines import pipeline_stepper

        from meshwise.models.gpt import GPT, GPTConfig, language_model_loss
        from meshwise.parallel.pipeline_parallel import chunk_parameters
        from meshwise.parallel.pipeline_parallel.builder import micro_batches_of
        from meshwise.parallel.pipeline_parallel.partition import chunks_of_rank, tied_parameters

        # bench_pipeline's "tiny" GPT and micro-batch of 4 sequences (that module imports today's names only)
        m, rank, config = 4, world.rank, GPTConfig(layers=4, hidden=64, heads=4, seq_len=64, vocab=256)
        torch.manual_seed(0)
        model = GPT(config)
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, config.vocab, (4 * m, config.seq_len + 1), generator=generator)
        x, y = tokens[:, :-1], tokens[:, 1:]
        executor, chunks, every_chunk = _pipeline(model, world.comm, schedule, m)
        ours_opt = torch.optim.SGD(chunk_parameters(chunks), lr=0.01)
        inputs, targets = micro_batches_of(x, m), micro_batches_of(y, m)

        def ours() -> None:
            ours_opt.zero_grad()
            executor.step(inputs if rank == 0 else None, targets if rank == 1 else None)
            ours_opt.step()

        local = chunks_of_rank(every_chunk, rank, 2)
        stage = PipelineStage(local[0], rank, 2, torch.device("cpu"))
        pipe = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stage, m, loss_fn=language_model_loss)
        theirs_opt = torch.optim.SGD(chunk_parameters(local), lr=0.01)
        tied = tied_parameters(local)

        theirs = pipeline_stepper(pipe, theirs_opt, tied, rank == 0, x, y)

        return {"torch/gloo": theirs, "meshwise/gloo": ours}, executor.close

    return group


GROUPS: dict[str, Callable] = {
    "dp": _dp_group,
    "zero3": _zero3_group,
    "tp": _tp_group,
    "pp-gpipe": _pp_group("gpipe"),
    "pp-1f1b": _pp_group("1f1b"),
}


def _measure(groups: list[str], rounds: int, steps: int, warmup: int) -> dict[str, dict[str, list[float]]]:
    """In each rank: each group's contenders built, timed in rotating rounds, released."""
    import torch.distributed as dist
    from bench_ddp import _time_rounds

    import meshwise
    from meshwise.comm.shm import ShmCommunicator

    world = meshwise.init("gloo", device="cpu", timeout=600)
    shm = ShmCommunicator.from_process_group(None, timeout=600)
    samples = {}
    try:
        for name in groups:
            steppers, release = GROUPS[name](world, shm)
            samples[name] = _time_rounds(steppers, rounds, steps, warmup, dist.barrier)
            del steppers
            release()  # torch's DDP/FSDP2 hold the process group: release them before shutdown
            gc.collect()
    finally:
        shm.close()
        meshwise.shutdown()
    return samples


def _worker(out: str, groups: list[str], rounds: int, steps: int, warmup: int) -> None:
    from meshwise.runtime.spawn import spawn

    samples = spawn(_measure, 2, args=(groups, rounds, steps, warmup), timeout=3000)[0]
    Path(out).write_text(json.dumps(samples))


# --- orchestrating (one process; starts a worker per source tree per round) ---------------------------------


def _source_of(revision: str, into: Path) -> Path:
    """``revision``'s ``src`` extracted under ``into``; exits with one line if git does not know it."""
    archive = subprocess.run(["git", "-C", str(REPOSITORY), "archive", revision, "src"], capture_output=True)
    if archive.returncode != 0:
        sys.exit(f"--before {revision}: git archive failed: {archive.stderr.decode().strip()}")
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "src"


def _run_worker(source: Path, groups: list[str], rounds: int, steps: int, warmup: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source), str(BENCHMARKS)])}
        command = [sys.executable, __file__, "--worker", out.name, "--groups", ",".join(groups),
                   "--rounds", str(rounds), "--steps", str(steps), "--warmup", str(warmup)]  # fmt: skip
        subprocess.run(command, env=env, check=True, timeout=3600)
        return json.loads(Path(out.name).read_text())


def _table(per_run: dict[str, dict[str, list[list[float]]]], recorded: dict, rev: str | None) -> str:
    """Medians, the spread of the runs' own medians (how much the machine moved them), after/before."""
    now = {name: median_ratio(runs) for name, runs in per_run["now"].items()}
    before = {name: median_ratio(runs) for name, runs in per_run["before"].items()} if rev else None
    header = f"{'ratio (ours / torch)':<22}{'now':>7}{'runs':>12}"
    if before is not None:
        header += f"{'at ' + str(rev):>12}{'now/before':>11}  {'±3 %':<5}"
    header += f"{'recorded':>9}{'now/rec.':>9}"
    lines = [header]
    for name, ratio in now.items():
        spread = [statistics.median(run) for run in per_run["now"][name]]
        line = f"{name:<22}{ratio:>7.3f}{f'{min(spread):.2f}–{max(spread):.2f}':>12}"
        if before is not None:
            change = ratio / before[name]
            verdict = "ok" if abs(change - 1) <= TOLERANCE else ("better" if change < 1 else "WORSE")
            line += f"{before[name]:>12.3f}{change:>11.3f}  {verdict:<5}"
        old = recorded.get(name)
        line += f"{old:>9.3f}{ratio / old:>9.3f}" if old else f"{'–':>9}{'':>9}"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", metavar="REV", help="also measure this git revision's src, side by side")
    parser.add_argument("--rounds", type=int, default=3, help="worker runs per source tree (default 3)")
    parser.add_argument("--inner-rounds", type=int, default=3, help="timed rounds per group per run")
    parser.add_argument("--steps", type=int, default=2, help="steps per timed round (default 2)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per contender first")
    parser.add_argument("--groups", default=",".join(GROUPS), help=f"comma-separated, of {','.join(GROUPS)}")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    groups = args.groups.split(",")
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        parser.error(f"--groups: {unknown} unknown; choose from {','.join(GROUPS)}")
    if args.worker:
        _worker(args.worker, groups, args.rounds, args.steps, args.warmup)
        return
    with tempfile.TemporaryDirectory() as scratch:
        # a copy: edits to the working tree while the run goes on do not change what "now" measures
        trees = {"now": Path(shutil.copytree(REPOSITORY / "src", Path(scratch, "now", "src")))}
        if args.before:
            trees["before"] = _source_of(args.before, Path(scratch, "before"))
        runs: dict[str, list] = {label: [] for label in trees}
        loads = []
        for r in range(args.rounds):
            for label in list(trees) if r % 2 == 0 else list(trees)[::-1]:
                print(
                    f"# round {r + 1}/{args.rounds}: {label}, load {os.getloadavg()[0]:.1f}", file=sys.stderr
                )
                loads.append(os.getloadavg()[0])
                runs[label].append(
                    _run_worker(trees[label], groups, args.inner_rounds, args.steps, args.warmup)
                )
    per_run = {label: paired_ratios(samples) for label, samples in runs.items()}
    ratios = {
        label: {name: median_ratio(r) for name, r in values.items()} for label, values in per_run.items()
    }
    recorded = recorded_ratios(BENCHMARKS / "results")
    print(f"2 ranks, gloo/CPU; medians of per-round ratios over {args.rounds} runs × {args.inner_rounds} "
          f"rounds × {args.steps} steps; load average {min(loads):.1f}–{max(loads):.1f}")  # fmt: skip
    print(_table(per_run, recorded, args.before))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        out = {"args": vars(args), "ratios": ratios, "recorded": recorded, "loads": loads, "runs": runs}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
