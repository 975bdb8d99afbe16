"""ZeRO-3 over tensor parallelism (zero3·tp2 on 4 ranks) vs torch's own 2D, side by side in one run.

The model is ``gpt-nano`` trained with AdamW on the same tokens, from the same initial weights, on a
2 × 2 mesh (dp outer, tp inner: tp ranks are neighbours in both):

- ``torch-2d``: torch's ``parallelize_module`` with a Megatron plan (q/k/v and fc column-wise, out and
  proj row-wise; embeddings and head replicated) on the mesh's tp dimension, then ``fully_shard`` on
  every block and on the root over its dp dimension — FSDP2 over DTensor TP, torchtitan's 2D;
- ``meshwise``: what ``meshwise train gpt --zero 3 --tp 2`` builds — the GPT's tensor-parallel plan
  (vocabulary-parallel embedding and head too) on ``mesh.tp``, then ``shard(stage=3)`` of those shards
  over ``mesh.dp`` with the blocks as units.

Each round times ``--steps`` steps of each in turn (the order alternates); a step's time is the slowest
rank's; the table gives medians over rounds and the median of per-round ratios. Memory per rank: the
accounted tensor bytes held between steps (parameters, gradients, optimizer state) and, in a fresh pair
of processes per configuration, the peak resident-memory growth (VmHWM) over building and two steps.

    python benchmarks/bench_compose.py --json benchmarks/results/c25_compose.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch_baselines import dtensor_tensor_parallel, fully_shard_blocks

import meshwise
from meshwise.comm.mesh import MeshShape
from meshwise.models.gpt import CONFIGS, GPT, language_model_loss
from meshwise.models.gpt_plan import gpt_plan
from meshwise.parallel.tensor_parallel import vocab_parallel_cross_entropy
from meshwise.parallel.zero import shard
from meshwise.runtime.memory import peak_resident_bytes
from meshwise.runtime.spawn import spawn
from meshwise.train.gpt.parallelize import tensor_parallel_key
from meshwise.world import World

NAMES = ("torch-2d", "meshwise")
SHAPE = MeshShape(dp=2, tp=2)


def _build(name: str, config: str, world: World) -> tuple[nn.Module, torch.optim.Optimizer, Callable]:
    """The model, its optimizer and its loss of (output, targets)."""
    torch.manual_seed(0)
    model: nn.Module = GPT(CONFIGS[config])
    mesh = world.mesh
    if name == "torch-2d":
        device_mesh = mesh.device_mesh()
        fully_shard_blocks(dtensor_tensor_parallel(model, device_mesh["tp"]), device_mesh["dp"])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), language_model_loss
    gpt_plan(model.config).tensor_parallel.convert(model, mesh.tp, False)  # type: ignore[union-attr]
    units = list(model.blocks)
    sharded = shard(model, mesh.dp, stage=3, units=units, separate_by=tensor_parallel_key)
    vocab = CONFIGS[config].vocab

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, mesh.tp, vocab=vocab)

    return sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-4), loss


def _stepper(built: tuple[nn.Module, torch.optim.Optimizer, Callable], tokens: torch.Tensor) -> Callable:
    model, optimizer, loss_of = built
    x, y = tokens[:, :-1], tokens[:, 1:]
    losses: list[float] = []

    def step() -> None:
        optimizer.zero_grad()
        loss = loss_of(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    step.losses = losses  # type: ignore[attr-defined]
    return step


def _tokens(config: str, batch: int, seq: int, dp_index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(dp_index)  # tp ranks of one dp replica read the same tokens
    return torch.randint(0, CONFIGS[config].vocab, (batch, seq + 1), generator=generator)


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def _accounted(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Per-rank bytes of parameters, gradients and optimizer state held between steps (local shards)."""

    def nbytes(t: torch.Tensor) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.numel() * local.element_size()

    params = list(model.parameters())
    state = sum(nbytes(v) for p in params for v in optimizer.state.get(p, {}).values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)  # fmt: skip
    grads = sum(nbytes(p.grad) for p in params if p.grad is not None)
    if hasattr(model, "groups"):  # ours: gradient shards live in the groups between steps
        grads = sum(g.grad_shard.numel() * g.grad_shard.element_size() for g in model.groups
                    if g.grad_shard is not None)  # fmt: skip
    return sum(nbytes(p) for p in params) + grads + state


def _timed(config: str, batch: int, seq: int, rounds: int, steps: int, warmup: int) -> dict:
    world = meshwise.init("gloo", device="cpu", timeout=600, mesh=SHAPE)
    tokens = _tokens(config, batch, seq, world.mesh.coordinates["dp"])
    built = {name: _build(name, config, world) for name in NAMES}
    steppers = {name: _stepper(b, tokens) for name, b in built.items()}
    for name in NAMES:
        for _ in range(warmup):
            steppers[name]()
    samples: dict[str, list[float]] = {name: [] for name in NAMES}
    for r in range(rounds):
        for name in NAMES if r % 2 == 0 else NAMES[::-1]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                steppers[name]()
            samples[name].append(_slowest(time.perf_counter() - start) / steps)
    memory = {name: _accounted(model, opt) for name, (model, opt, _) in built.items()}
    first_loss = {name: steppers[name].losses[0] for name in NAMES}  # type: ignore[attr-defined]
    del built, steppers  # FSDP2 holds the process group: release it before shutdown
    meshwise.shutdown()
    return {"samples": samples, "memory": memory, "first_loss": first_loss}


def _rss_one(name: str, config: str, batch: int, seq: int) -> int:
    world = meshwise.init("gloo", device="cpu", timeout=600, mesh=SHAPE)
    before = peak_resident_bytes() or 0
    built = _build(name, config, world)
    step = _stepper(built, _tokens(config, batch, seq, world.mesh.coordinates["dp"]))
    for _ in range(2):
        step()
    grown = (peak_resident_bytes() or 0) - before
    del built, step
    meshwise.shutdown()
    return grown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="gpt-nano", choices=list(CONFIGS), help="GPT size")
    parser.add_argument("--batch", type=int, default=2, help="sequences per dp replica per step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per configuration")
    parser.add_argument("--steps", type=int, default=2, help="steps per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per configuration first")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    job = (args.config, args.batch, args.seq, args.rounds, args.steps, args.warmup)
    result = spawn(_timed, 4, args=job, timeout=3000)[0]
    rss = {name: max(spawn(_rss_one, 4, args=(name, *job[:3]), timeout=1200)) for name in NAMES}
    samples = result["samples"]
    ratios = [ours / theirs for ours, theirs in zip(samples["meshwise"], samples["torch-2d"], strict=True)]
    rows = {
        name: {
            "step_seconds": statistics.median(samples[name]),
            "accounted_bytes": result["memory"][name],
            "peak_rss_growth_bytes": rss[name],
            "first_loss": result["first_loss"][name],
        }
        for name in NAMES
    }
    print(f"zero3·tp2 vs torch 2D (FSDP2 over DTensor TP), {args.config}, 4 ranks (dp 2 × tp 2), gloo/CPU, "
          f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'':10} {'step s (median)':>16} {'accounted MiB':>14} {'peak RSS MiB':>13} {'first loss':>11}")
    for name, row in rows.items():
        print(f"{name:10} {row['step_seconds']:>16.4f} {row['accounted_bytes'] / 2**20:>14.2f} "
              f"{row['peak_rss_growth_bytes'] / 2**20:>13.1f} {row['first_loss']:>11.5f}")  # fmt: skip
    memory_ratio = rows["meshwise"]["peak_rss_growth_bytes"] / rows["torch-2d"]["peak_rss_growth_bytes"]
    print(f"meshwise / torch-2d: step time {statistics.median(ratios):.3f}× (median of per-round ratios), "
          f"peak RSS {memory_ratio:.3f}×")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "rows": rows, "step_ratio_median": statistics.median(ratios),
            "peak_rss_ratio": memory_ratio, "samples": samples, "load": os.getloadavg(),
        }, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
