"""``meshwise train gpt --cp N`` measured through the real trainer: tokens/s, activation memory per rank,
and the longest sequence that trains in a fixed memory budget per rank.

Every number comes from :meth:`GPTTrainer.train_step` on the mesh the flags give (the layout, data slicing,
gradient reduction and AdamW of a real run). The model is GPT-2's 1024-position table with a small body
(``--config gpt2 --layers 4 --hidden 256 --heads 4 --vocab 256``): a long table, so sequences up to 1024
can be trained, and a body that steps in seconds on a CPU.

- **Throughput** (2 ranks): cp2 at ``2L`` vs dp2 at ``L`` with the same tokens per step (``B`` sequences
  of ``2L`` split over the cp pair, or ``2B`` sequences of ``L``, one half per dp rank), timed in
  alternating rounds after a warm-up step each; medians and the median per-round ratio, of wall time and
  of CPU seconds (the busier rank's: on a loaded machine the steadier measure of work).
- **Memory** (2 ranks): bytes saved for backward in one training step (saved-tensor hooks, parameters
  excluded: :class:`~meshwise.parallel.recompute.SavedBytes`), per rank, at ``2L``: cp2 (half of one
  sequence each) vs one process's share (one whole sequence each, dp2), under each recomputation mode.
  Goal: cp2 ≤ 0.55× one process.
- **Longest sequence in a budget** (4 ranks): per rank, 16 bytes per parameter (fp32 weights, gradients,
  AdamW's two moments) plus the bytes saved for backward in a real step, plus — under full recomputation —
  one block's activations, which backward recomputes one block at a time (the none-mode bytes of the
  largest block at that length). Bisection over multiples of 32 up to the position table, each probe one
  step per mode on cp1 (dp4, one sequence per rank), cp2 (dp2·cp2) and cp4. Four ranks on a 2-core machine
  are oversubscribed: the memory is exact, the time is not, and no time is reported for it.

    python benchmarks/bench_cp_train.py --json benchmarks/results/cp_train.json
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from bench_ddp import _medians, _paired_ratios

import meshwise
from meshwise.comm.api import ReduceOp
from meshwise.comm.mesh import Mesh
from meshwise.models.gpt import Block
from meshwise.parallel.protocols import recomputable_blocks
from meshwise.parallel.recompute import MODES, SavedBytes, apply_recompute
from meshwise.runtime.spawn import spawn
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.loop import GPTTrainer
from meshwise.train.gpt.resolve import model_config, resolve
from meshwise.world import World

MODEL = {"config": "gpt2", "layers": 4, "hidden": 256, "heads": 4, "vocab": 256}
TARGET_MEMORY_RATIO = 0.55  # cp2 per-rank activations at 2L vs one process at 2L, at most
GRID = 32  # sequence lengths searched: multiples of this (of 2·cp for every cp ≤ 16)


def _config(data: str, nproc: int, seq: int, batch: int, **flags: int | str) -> GPTTrainConfig:
    return GPTTrainConfig.from_flags(
        nproc=nproc,
        data=data,
        seq_len=seq,
        global_batch=batch,
        steps=1000,
        warmup=0,
        backend="gloo",
        **MODEL,
        **flags,  # type: ignore[arg-type]
    )


def _trainer(world: World, config: GPTTrainConfig) -> tuple[GPTTrainer, Mesh]:
    """A trainer on the config's mesh over the world's ranks (collective: every rank builds it)."""
    mesh = Mesh(world.comm, config.mesh_shape(world.world_size))
    return GPTTrainer(replace(world, mesh=mesh), resolve(config)), mesh


def _measured_step(trainer: GPTTrainer, step: int, mode: str) -> dict[str, float]:
    """One training step under recomputation ``mode``: bytes saved for backward on this rank (in all, and
    the largest block's) and the step's seconds."""
    model = trainer.step_runner.model
    apply_recompute(recomputable_blocks(model), mode)
    measurement = SavedBytes(exclude=model.parameters())
    handles = measurement.per_layer([(n, m) for n, m in model.named_modules() if isinstance(m, Block)])
    try:
        with measurement.recording():
            stats = trainer.train_step(step)
    finally:
        handles.remove()
    per_scope = measurement.bytes_per_call()
    blocks = [v for k, v in per_scope.items() if k != "total"]
    return {"saved": sum(per_scope.values()), "block": max(blocks), "seconds": stats.seconds}


def _two_ranks(data: str, half: int, batch: int, rounds: int) -> dict:
    """Throughput (cp2 at 2L vs dp2 at L) and memory at 2L (cp2 vs one sequence per rank)."""
    world = meshwise.init("gloo", timeout=900)
    meshes = []
    try:
        runs = {
            "cp2 at 2L": _config(data, 2, 2 * half, batch, cp=2),
            "dp2 at L": _config(data, 2, half, 2 * batch),
        }
        trainers = {}
        for name, config in runs.items():
            trainers[name], mesh = _trainer(world, config)
            meshes.append(mesh)
            trainers[name].train_step(0)  # warm-up
        samples: dict[str, list[float]] = {name: [] for name in runs}
        cpu: dict[str, list[float]] = {name: [] for name in runs}
        names = list(runs)
        for r in range(rounds):
            for name in names[r % 2 :] + names[: r % 2]:
                started = time.process_time()
                samples[name].append(trainers[name].train_step(1 + r).seconds)
                used = torch.tensor([time.process_time() - started], dtype=torch.float64)
                world.comm.all_reduce(used, ReduceOp.MAX)  # the busier rank's
                cpu[name].append(used.item())
        memory = {}
        one, mesh = _trainer(world, _config(data, 2, 2 * half, 2 * batch))  # a whole sequence per rank
        meshes.append(mesh)
        for mode in MODES:
            memory[f"one process {mode}"] = _measured_step(one, 0, mode)["saved"]
            memory[f"cp2 {mode}"] = _measured_step(trainers["cp2 at 2L"], rounds + 1, mode)["saved"]
        return {
            "seconds": samples,
            "median": _medians(samples),
            "ratios": _paired_ratios(samples, "dp2 at L"),
            "cpu_seconds": cpu,
            "cpu_median": _medians(cpu),
            "cpu_ratios": _paired_ratios(cpu, "dp2 at L"),
            "memory": memory,
        }
    finally:
        for mesh in meshes:
            mesh.close()
        meshwise.shutdown()


def _four_ranks(data: str, budget: float, top: int) -> dict:
    """The longest sequence (a multiple of GRID, ≤ top) that fits ``budget`` bytes per rank, per cp and
    recomputation mode, by bisection over real steps."""
    world = meshwise.init("gloo", timeout=900)
    layouts = {1: {"batch": 4}, 2: {"batch": 2, "cp": 2}, 4: {"batch": 1, "cp": 4}}
    found: dict = {}
    try:
        for cp, layout in layouts.items():
            probes: dict[int, dict[str, dict[str, float]]] = {}

            def probe(seq: int, cp: int = cp, layout: dict = layout, probes: dict = probes) -> dict:
                if seq not in probes:
                    flags = {k: v for k, v in layout.items() if k != "batch"}
                    trainer, mesh = _trainer(world, _config(data, 4, seq, layout["batch"], **flags))
                    try:
                        probes[seq] = {mode: _measured_step(trainer, 0, mode) for mode in MODES}
                    finally:
                        mesh.close()
                    params = sum(p.numel() for p in trainer.step_runner.model.parameters())
                    for mode, row in probes[seq].items():
                        transient = probes[seq]["none"]["block"] if mode == "full" else 0.0
                        row["total"] = 16 * params + row["saved"] + transient
                return probes[seq]

            for mode in MODES:
                low, high = 0, top // GRID  # fits at low·GRID (0: nothing), unknown above
                if probe(high * GRID)[mode]["total"] <= budget:
                    low = high
                while high - low > 1:
                    middle = (low + high) // 2
                    if probe(middle * GRID)[mode]["total"] <= budget:
                        low = middle
                    else:
                        high = middle
                found[f"cp{cp} {mode}"] = {"longest": low * GRID, "capped": low * GRID == top}
            found[f"cp{cp} probes"] = {str(s): v for s, v in sorted(probes.items())}
        return found
    finally:
        meshwise.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--half", type=int, default=512, help="L: dp2 trains at L, cp2 at 2L (default 512)")
    parser.add_argument("--batch", type=int, default=1, help="sequences of 2L per step for cp2 (default 1)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--budget-mib", type=float, default=60.0, help="memory per rank (default 60 MiB)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        data = str(Path(scratch) / "argparse.txt")
        Path(data).write_bytes((Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_bytes())
        two = spawn(_two_ranks, 2, args=(data, args.half, args.batch, args.rounds), timeout=3600)[0]
        top = model_config(GPTTrainConfig.from_flags(**MODEL)).seq_len
        four = spawn(_four_ranks, 4, args=(data, args.budget_mib * 2**20, top), timeout=3600)[0]
    seq, tokens = 2 * args.half, 2 * args.batch * args.half
    memory = two["memory"]
    lines = [
        f"gpt2-shaped 4×256 (1024 positions, vocab 256), fp32, load {os.getloadavg()[0]:.1f}",
        "",
        f"two ranks, {tokens} tokens per step in both:",
    ]
    for name, seconds in two["median"].items():
        rate, ratio = tokens / seconds, two["ratios"][name]
        cpu, cpu_ratio = two["cpu_median"][name], two["cpu_ratios"][name]
        lines.append(
            f"  {name:<10} {seconds:8.3f} s/step  {rate:10,.0f} tokens/s  {ratio:.3f}× dp2's time;  "
            f"CPU {cpu:6.3f} s/step ({cpu_ratio:.3f}×)"
        )
    lines += ["", f"saved for backward per rank at 2L = {seq} (MiB; cp2 vs one process)"]
    for mode in MODES:
        one, cp2 = memory[f"one process {mode}"], memory[f"cp2 {mode}"]
        lines.append(f"  {mode:<10} one process {one / 2**20:8.2f}  cp2 {cp2 / 2**20:8.2f}  {cp2 / one:.3f}×")
    lines.append(f"  goal: cp2 ≤ {TARGET_MEMORY_RATIO}× one process")
    lines += ["", f"longest sequence in {args.budget_mib:g} MiB per rank (cp4: 4 ranks on 2 cores):"]
    lines.append(f"  {'':<6}" + "".join(f"{mode:>12}" for mode in MODES))
    for cp in (1, 2, 4):
        cells = [four[f"cp{cp} {mode}"] for mode in MODES]
        lines.append(
            f"  cp{cp:<4}" + "".join(f"{c['longest']:>11,}{'+' if c['capped'] else ' '}" for c in cells)
        )
    lines.append(f"  (+: the {top}-position table, not memory, is the limit)")
    print("\n".join(lines))
    if args.json:
        result = {
            "model": MODEL,
            "half": args.half,
            "batch": args.batch,
            "load": os.getloadavg()[0],
            "throughput": {k: v for k, v in two.items() if k != "memory"},
            "memory": memory,
            "budget_mib": args.budget_mib,
            "longest": four,
        }
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
