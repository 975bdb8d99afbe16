"""Context parallelism on gpt-nano: activation memory per rank, tokens/s, and the longest sequence that fits.

- **Memory**: bytes saved for backward by one training forward of the whole model (saved-tensor hooks,
  parameters excluded, :class:`meshwise.parallel.recompute.SavedBytes`) on one rank, at sequence ``2L``:
  one process vs cp2 and cp4 (each rank holds ``2L/cp`` tokens), under each recomputation mode. Target:
  cp2 at ``2L`` ≤ 0.55× one process at ``2L``. The all-gather design keeps the gathered keys and values
  (``2·s·h`` values per layer, the whole sequence's) for backward unless the attention core is recomputed.
- **Throughput**: cp2 at ``2L`` vs dp2 at ``L`` on two ranks — the same tokens per step (one sequence of
  ``2L`` split over the ranks, or one sequence of ``L`` per rank) — forward, backward, the gradient average
  over the two ranks and AdamW, timed in alternating rounds; medians and the median per-round ratio.
- **Longest sequence in a budget**: measured bytes at two lengths give, per configuration, activation
  bytes = α·s + β·s² (β is the attention-score term; zero when the kernel keeps none); under full
  recomputation one block's activations, recomputed in backward, are added. With 16 bytes per parameter
  of fp32 weights, gradients and AdamW moments, the longest ``s`` (a multiple of 2·cp) whose total fits
  ``--budget-gib`` per rank. Backward's other transients (a layer's activation gradients, the logits'
  gradient) are not modelled.

    python benchmarks/bench_context_parallel.py --json benchmarks/results/x28_context_parallel.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import replace
from pathlib import Path

import torch
from bench_ddp import _medians, _paired_ratios, _time_rounds

import meshwise
from meshwise.comm.api import Communicator
from meshwise.comm.mesh import MeshShape
from meshwise.models.gpt import GPT, GPTConfig, gpt_config, language_model_loss
from meshwise.parallel.context_parallel import apply_context_parallel, average_gradients, split_sequence
from meshwise.parallel.protocols import recomputable_blocks
from meshwise.parallel.recompute import MODES, SavedBytes, apply_recompute
from meshwise.runtime.spawn import spawn

TARGET_MEMORY_RATIO = 0.55  # cp2 per-rank activations at 2L vs one process at 2L, at most


def _model(config: GPTConfig, comm: Communicator | None, mode: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(config).train()
    if comm is not None:
        apply_context_parallel(model, comm)
    apply_recompute(recomputable_blocks(model), mode)
    return model


def _tokens(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))


def _saved(model: GPT, tokens: torch.Tensor, comm: Communicator | None) -> int:
    """Bytes one training forward of ``model`` saves on this rank (its share of ``tokens``)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if comm is not None:
        inputs, targets = (split_sequence(t, comm.world_size, comm.rank) for t in (inputs, targets))
    measurement = SavedBytes(exclude=model.parameters())
    with measurement.recording():
        loss = language_model_loss(model(inputs), targets)
    loss.backward()  # collective under cp: every rank runs it
    return int(sum(measurement.bytes_per_call().values()))


def _memory_rank(config: GPTConfig, batch: int, lengths: list[int]) -> dict:
    """Saved bytes per rank for cp1 (alone), cp2 (pairs) and cp4 (all four) at each length and mode."""
    world = meshwise.init("gloo", timeout=600, mesh=MeshShape(dp=2, tp=2))
    try:
        groups = {1: None, 2: world.mesh.tp, 4: world.comm}
        found: dict = {}
        for seq in lengths:
            for cp, comm in groups.items():
                for mode in MODES:
                    model = _model(replace(config, seq_len=seq), comm, mode)
                    found[f"cp{cp} {mode} {seq}"] = _saved(model, _tokens(batch, seq), comm)
        return found
    finally:
        meshwise.shutdown()


def _throughput_rank(config: GPTConfig, batch: int, half: int, rounds: int, warmup: int) -> dict:
    """cp2 at 2L vs dp2 at L: step seconds per round (the slower rank's)."""
    world = meshwise.init("gloo", timeout=600)
    try:
        comm, rank = world.comm, world.rank
        runs = {
            "cp2 at 2L": (
                _model(replace(config, seq_len=2 * half), comm, "none"),
                _tokens(batch, 2 * half),
                True,
            ),
            "dp2 at L": (
                _model(replace(config, seq_len=half), None, "none"),
                _tokens(batch, half, 2 + rank),
                False,
            ),
        }
        steppers = {}
        for name, (model, tokens, split) in runs.items():
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            if split:
                inputs, targets = (split_sequence(t, 2, rank) for t in (inputs, targets))

            def step(model=model, optimizer=optimizer, inputs=inputs, targets=targets) -> None:
                optimizer.zero_grad(set_to_none=True)
                language_model_loss(model(inputs), targets).backward()
                average_gradients(model.parameters(), comm)
                optimizer.step()

            steppers[name] = step

        def slowest() -> None:
            comm.barrier()

        samples = _time_rounds(steppers, rounds, 1, warmup, slowest)
        return {
            "seconds": samples,
            "median": _medians(samples),
            "ratios": _paired_ratios(samples, "dp2 at L"),
        }
    finally:
        meshwise.shutdown()


def longest(alpha: float, beta: float, fixed: float, budget: float, multiple: int) -> int:
    """The largest multiple of ``multiple`` with fixed + α·s + β·s² ≤ budget."""
    room = budget - fixed
    s = room / alpha if beta <= 0 else (-alpha + math.sqrt(alpha * alpha + 4 * beta * room)) / (2 * beta)
    return int(s // multiple * multiple)


def budget_table(memory: dict, config: GPTConfig, lengths: list[int], budget: float) -> dict:
    low, high = lengths
    fixed = 16 * GPT(replace(config, seq_len=high)).config.num_parameters()
    rows = {}
    for cp in (1, 2, 4):
        for mode in MODES:
            a, b = memory[f"cp{cp} {mode} {low}"], memory[f"cp{cp} {mode} {high}"]
            # a = α·low + β·low², b = α·high + β·high²
            beta = max(0.0, (b / high - a / low) / (high - low))
            alpha = a / low - beta * low
            if mode == "full":  # backward recomputes one block at a time: its activations come on top
                alpha += (memory[f"cp{cp} none {high}"] - b) / high / config.layers
            rows[f"cp{cp} {mode}"] = {
                "alpha": alpha,
                "beta": beta,
                "longest": longest(alpha, beta, fixed, budget, 2 * cp),
            }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="gpt-nano", help="named GPT size (default gpt-nano)")
    parser.add_argument("--half", type=int, default=512, help="L: dp2 trains at L, cp2 at 2L (default 512)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank per step (default 1)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per configuration first")
    parser.add_argument("--budget-gib", type=float, default=4.0, help="memory per rank (default 4 GiB)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    config = gpt_config(args.config)
    lengths = [args.half, 2 * args.half]
    memory = spawn(_memory_rank, 4, args=(config, args.batch, lengths), timeout=3600)[0]
    speed = spawn(
        _throughput_rank, 2, args=(config, args.batch, args.half, args.rounds, args.warmup), timeout=3600
    )[0]
    budget = budget_table(memory, config, lengths, args.budget_gib * 2**30)
    seq = 2 * args.half
    one = memory[f"cp1 none {seq}"]
    lines = [
        f"{args.config}, batch {args.batch}, fp32, load {os.getloadavg()[0]:.1f}",
        "",
        f"saved for backward per rank at sequence 2L = {seq} (MiB, and vs one process without recomputation)",
        f"  {'':<6}" + "".join(f"{mode:>22}" for mode in MODES),
    ]
    for cp in (1, 2, 4):
        cells = [memory[f"cp{cp} {mode} {seq}"] for mode in MODES]
        lines.append(f"  cp{cp:<4}" + "".join(f"{c / 2**20:>12.1f} ({c / one:5.3f}×)" for c in cells))
    cp2 = memory[f"cp2 none {seq}"] / one
    lines.append(f"  cp2 none vs one process: {cp2:.3f}× (target ≤ {TARGET_MEMORY_RATIO})")
    tokens = args.batch * seq
    lines += ["", f"two ranks, {tokens} tokens per step in both:"]
    for name, seconds in speed["median"].items():
        rate, ratio = tokens / seconds, speed["ratios"][name]
        lines.append(f"  {name:<10} {seconds:8.3f} s/step  {rate:10,.0f} tokens/s  {ratio:.3f}× dp2's time")
    lines += [
        "",
        f"longest sequence in {args.budget_gib:g} GiB per rank (model states "
        f"{16 * config.num_parameters() / 2**30:.2f} GiB, activations fitted as αs + βs²):",
    ]
    lines.append(f"  {'':<6}" + "".join(f"{mode:>12}" for mode in MODES))
    for cp in (1, 2, 4):
        lines.append(
            f"  cp{cp:<4}" + "".join(f"{budget[f'cp{cp} {mode}']['longest']:>12,}" for mode in MODES)
        )
    print("\n".join(lines))
    if args.json:
        result = {
            "config": args.config,
            "half": args.half,
            "batch": args.batch,
            "load": os.getloadavg()[0],
            "memory": memory,
            "throughput": speed,
            "budget": budget,
            "budget_gib": args.budget_gib,
        }
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
