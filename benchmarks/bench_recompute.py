"""Activation recomputation on gpt-nano at sequence 1024: bytes saved per layer and step time per mode.

For each attention-dropout setting (0: PyTorch's CPU attention is a fused kernel that keeps no s × s
tensor; 0.1: it falls back to the materialising kernel, the case Korthikanti et al.'s ``5as/h`` term
describes) and each mode (none, selective, full):

- **saved bytes per layer**: one training step recorded with saved-tensor hooks, each block's saves
  attributed to it (:class:`meshwise.parallel.recompute.SavedBytes`), averaged over the blocks; beside it
  the paper's formula as published (16-bit values, 1-byte masks) and the same formula for this run's value
  and mask sizes and attention kernel (:func:`~meshwise.parallel.recompute.formulas.layer_saved_bytes`) —
  the one the measurement must match within 10 %;
- **step time**: forward, backward and AdamW of the whole model on one process, each mode timed in turn
  every round (the order rotating), wall and CPU seconds, reported as medians and as the median of
  per-round ratios to ``none`` (targets: selective ≤ 1.10×, full ≤ 1.40×; Megatron measured +29–32 % for
  full). On a machine shared with other work, CPU seconds are the steadier of the two.

Every mode starts from the same weights, batch and random seed, so the losses must be equal (bit for bit).

    python benchmarks/bench_recompute.py --json benchmarks/results/x28_recompute.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from bench_ddp import _medians, _paired_ratios

from meshwise.models.gpt import GPT, gpt_config, language_model_loss
from meshwise.parallel.protocols import recomputable_blocks
from meshwise.parallel.recompute import MODES, SavedBytes, apply_recompute, saved_bytes
from meshwise.parallel.recompute.formulas import attention_keeps_scores, layer_saved_bytes, paper_layer_bytes

TARGETS = {"none": 1.0, "selective": 1.10, "full": 1.40}  # step time vs none, at most
MEMORY_TOLERANCE = 0.10


class Run:
    """One model under one mode, with its batch: ``step()`` is one training step."""

    def __init__(self, config, mode: str, tokens: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        self.model = GPT(config).train()
        apply_recompute(recomputable_blocks(self.model), mode)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.tokens = tokens
        self.losses: list[float] = []

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(len(self.losses))  # the same dropout masks in every mode
        loss = language_model_loss(self.model(self.tokens[:, :-1]), self.tokens[:, 1:])
        loss.backward()
        self.optimizer.step()
        self.losses.append(loss.item())

    def saved_per_layer(self) -> float:
        measurement = SavedBytes(exclude=self.model.parameters())
        handles = measurement.per_layer([(str(i), b) for i, b in enumerate(self.model.blocks)])
        with measurement.recording():
            torch.manual_seed(0)
            loss = language_model_loss(self.model(self.tokens[:, :-1]), self.tokens[:, 1:])
        handles.remove()
        loss.backward()
        self.model.zero_grad(set_to_none=True)
        per = measurement.bytes_per_call()
        return sum(per[str(i)] for i in range(len(self.model.blocks))) / len(self.model.blocks)


def _time_rounds(steps: dict[str, Callable[[], None]], rounds: int, warmup: int) -> tuple[dict, dict]:
    """Wall and CPU seconds (this process, all threads) of one step of each mode per round, the order
    rotating every round. On a shared, loaded machine wall time swings by 2× from step to step; CPU time
    counts the work the step did and is the steadier comparison (both are reported)."""
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            started, cpu_started = time.perf_counter(), time.process_time()
            steps[name]()
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - cpu_started)
    return wall, cpu


def measure(args: argparse.Namespace) -> dict:
    base = replace(gpt_config(args.config), seq_len=args.seq)
    tokens = torch.randint(
        0, base.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1)
    )
    s, b, h, a = args.seq, args.batch, base.hidden, base.heads
    results: dict = {}
    for dropout in (0.0, 0.1):
        config = replace(base, dropout=dropout)
        runs = {mode: Run(config, mode, tokens) for mode in MODES}
        value = 4
        mask = saved_bytes(torch.nn.Dropout(0.5), torch.ones(64, requires_grad=True)) // 64
        scores = attention_keeps_scores(dropout)
        memory = {}
        for mode, run in runs.items():
            measured = run.saved_per_layer()
            formula = layer_saved_bytes(
                s, b, h, a, mode=mode, value_bytes=value, mask_bytes=mask, dropout=dropout > 0, scores=scores
            )
            memory[mode] = {
                "measured": measured,
                "formula": formula,
                "ratio": measured / formula,
                "paper_16bit": paper_layer_bytes(s, b, h, a, mode=mode),
            }
        samples, cpu = _time_rounds({mode: run.step for mode, run in runs.items()}, args.rounds, args.warmup)
        losses = {mode: run.losses for mode, run in runs.items()}
        results[f"dropout {dropout}"] = {
            "attention_keeps_scores": scores,
            "mask_bytes": mask,
            "memory": memory,
            "seconds": samples,
            "median_seconds": _medians(samples),
            "ratios": _paired_ratios(samples, "none"),
            "cpu_seconds": cpu,
            "cpu_ratios": _paired_ratios(cpu, "none"),
            "losses_equal": all(losses[m] == losses["none"] for m in MODES),
        }
    return results


def report(results: dict, args: argparse.Namespace) -> str:
    sbh = args.seq * args.batch * gpt_config(args.config).hidden
    lines = [
        f"{args.config} at sequence {args.seq}, batch {args.batch}, fp32, {torch.get_num_threads()} threads, "
        f"load {os.getloadavg()[0]:.1f}; bytes per layer in units of sbh = {sbh:,}"
    ]
    for setting, result in results.items():
        kernel = "materialising" if result["attention_keeps_scores"] else "fused (no s×s)"
        lines += [
            "",
            f"attention {setting}, {kernel} kernel, masks {result['mask_bytes']} B/element",
            f"  {'mode':<10}{'measured/sbh':>13}{'formula/sbh':>13}{'ratio':>7}{'paper 16-bit/sbh':>18}"
            f"{'step s':>9}{'vs none':>9}{'cpu s':>9}{'vs none':>9}{'target':>8}",
        ]
        for mode in MODES:
            m = result["memory"][mode]
            lines.append(
                f"  {mode:<10}{m['measured'] / sbh:>13.2f}{m['formula'] / sbh:>13.2f}{m['ratio']:>7.3f}"
                f"{m['paper_16bit'] / sbh:>18.2f}{result['median_seconds'][mode]:>9.3f}"
                f"{result['ratios'][mode]:>8.3f}×{statistics.median(result['cpu_seconds'][mode]):>9.3f}"
                f"{result['cpu_ratios'][mode]:>8.3f}×{TARGETS[mode]:>7.2f}×"
            )
        lines.append(f"  losses equal in every mode: {result['losses_equal']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="gpt-nano", help="named GPT size (default gpt-nano)")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (default 1024)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (default 1)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per mode (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per mode first")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    results = measure(args)
    print(report(results, args))
    if args.json:
        meta = {"config": args.config, "seq": args.seq, "batch": args.batch, "load": os.getloadavg()[0]}
        Path(args.json).write_text(json.dumps(meta | {"results": results}, indent=2))
    within = all(
        abs(m["ratio"] - 1) <= MEMORY_TOLERANCE for r in results.values() for m in r["memory"].values()
    )
    print(f"saved bytes within {MEMORY_TOLERANCE:.0%} of the formula in every mode: {within}")


if __name__ == "__main__":
    main()
