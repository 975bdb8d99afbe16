"""DataParallel vs torch's DistributedDataParallel, side by side in one run: training step time.

The model is the CS336 data-parallel example: 8 bias-free 1024×1024 linear layers with GELU (8.4M
parameters, 32 MiB of float32 gradients), a batch of 64 per rank, loss = mean squared output, plain SGD.
One step is zero_grad, forward, backward (gradients averaged across ranks) and the optimizer step.

On 2 ranks the same processes build three replicas from the same initial weights: torch DDP on gloo
(default settings), meshwise DataParallel on the same gloo group, and DataParallel on the shared-memory
transport. Each round times ``--steps`` consecutive steps of each configuration in turn (the order
rotates every round, so machine noise hits them alike) between barriers; a step's time is the slowest
rank's. The table reports the median step time over ``--rounds`` rounds, and the median of the per-round
ratios to the baseline (each round's configurations ran back to back, so the ratio of one round cancels
most of the drift a busy machine adds). All replicas take the same steps on the same data, so their final
weights must agree — the last line checks it.

On 1 rank it compares the plain model, DataParallel (nothing to average: a pass-through) and torch DDP,
to measure what wrapping costs when there is no communication; ``--device cuda`` runs that part on a GPU.

    python benchmarks/bench_ddp.py --json ddp.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import meshwise
from meshwise.comm.shm import ShmCommunicator
from meshwise.models import DeepMLP
from meshwise.parallel import DataParallel
from meshwise.runtime.spawn import spawn

TARGETS = {"meshwise/gloo": 1.05, "meshwise/shm": 0.70}  # step time vs torch DDP on gloo, at most
#: On one rank the wrapper may cost at most 2% over the plain model.
ONE_RANK_TARGET = 1.02


def _replica(seed: int, device: torch.device) -> nn.Module:
    torch.manual_seed(seed)
    return DeepMLP(1024, 8).to(device)


def _stepper(model: nn.Module, lr: float, x: torch.Tensor) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    def step() -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    return step


def _time_rounds(
    steppers: dict[str, Callable[[], None]], rounds: int, steps: int, warmup: int, sync: Callable[[], None]
) -> dict[str, list[float]]:
    """Per configuration, the seconds of one step in each round (slowest rank's, via ``sync``)."""
    names = list(steppers)
    for name in names:
        for _ in range(warmup):
            steppers[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            elapsed = _timed(steppers[name], steps, sync)
            samples[name].append(elapsed / steps)
    return samples


def _timed(step: Callable[[], None], steps: int, sync: Callable[[], None]) -> float:
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return _slowest(time.perf_counter() - start, sync)


def _slowest(seconds: float, sync: Callable[[], None]) -> float:
    sync()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return seconds
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def _two_ranks(batch: int, rounds: int, steps: int, warmup: int) -> dict[str, object]:
    world = meshwise.init("gloo", device="cpu", timeout=300)  # the comparison is of CPU transports
    shm = ShmCommunicator.from_process_group(None, timeout=300)
    device = world.device
    x = torch.randn(batch, 1024, generator=torch.Generator().manual_seed(world.rank)).to(device)
    models = {
        "torch/gloo": DistributedDataParallel(_replica(0, device)),
        "meshwise/gloo": DataParallel(_replica(0, device), world.comm),
        "meshwise/shm": DataParallel(_replica(0, device), shm),
    }
    steppers = {name: _stepper(model, 1e-3, x) for name, model in models.items()}
    samples = _time_rounds(steppers, rounds, steps, warmup, dist.barrier)
    reference = list(models["torch/gloo"].parameters())
    disagreement = max(
        (p - q).abs().max().item()
        for model in models.values()
        for p, q in zip(model.parameters(), reference, strict=True)
    )
    del models, steppers, reference  # torch's DDP holds the process group: release it before shutdown
    shm.close()
    meshwise.shutdown()
    return {"samples": samples, "max_weight_difference": disagreement}


def _one_rank(batch: int, rounds: int, steps: int, warmup: int, device_name: str) -> dict[str, object]:
    world = meshwise.init("auto", device=device_name, timeout=300)
    device = world.device
    x = torch.randn(batch, 1024, generator=torch.Generator().manual_seed(0)).to(device)
    models = {
        "plain": _replica(0, device),
        "meshwise": DataParallel(_replica(0, device), world.comm),
        "torch": DistributedDataParallel(_replica(0, device)),
    }
    steppers = {name: _stepper(model, 1e-3, x) for name, model in models.items()}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    samples = _time_rounds(steppers, rounds, steps, warmup, sync)
    del models, steppers  # torch's DDP holds the process group: release it before shutdown
    meshwise.shutdown()
    return {"samples": samples, "device": str(device)}


def _medians(samples: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in samples.items()}


def _paired_ratios(samples: dict[str, list[float]], base: str) -> dict[str, float]:
    """Median over rounds of each configuration's step time divided by the baseline's in that round."""
    return {
        name: statistics.median(t / b for t, b in zip(values, samples[base], strict=True))
        for name, values in samples.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step (default 64)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per configuration")
    parser.add_argument("--steps", type=int, default=4, help="steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration first")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device of the 1-rank part")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    job = (args.batch, args.rounds, args.steps, args.warmup)

    two = spawn(_two_ranks, 2, args=job, timeout=3600)[0]
    # one rank: cheap steps, so many rounds of one step each, pairing the configurations closely
    one = spawn(
        _one_rank, 1, args=(args.batch, args.rounds * args.steps, 1, args.warmup, args.device), timeout=3600
    )[0]
    two_ms, two_ratio = _medians(two["samples"]), _paired_ratios(two["samples"], "torch/gloo")
    one_ms, one_ratio = _medians(one["samples"]), _paired_ratios(one["samples"], "plain")

    print(f"8×1024 GELU MLP (8.4M params), batch {args.batch}/rank, SGD; medians of {args.rounds} rounds")
    print(f"{'ranks':>5}  {'configuration':<18}{'step ms':>9}  {'ratio':>7}  target")
    for name, seconds in two_ms.items():
        ratio = two_ratio[name]
        target = "vs torch/gloo" if name not in TARGETS else f"≤ {TARGETS[name]:.2f}"
        verdict = "" if name not in TARGETS else (" ok" if ratio <= TARGETS[name] else " MISSED")
        print(f"{2:>5}  {name:<18}{1e3 * seconds:>9.2f}  {ratio:>7.3f}  {target}{verdict}")
    for name, seconds in one_ms.items():
        ratio = one_ratio[name]
        verdict = " ok" if ratio <= ONE_RANK_TARGET else " MISSED"
        target = {"plain": "vs plain", "meshwise": f"≤ {ONE_RANK_TARGET:.2f}{verdict}"}.get(name, "")
        print(f"{1:>5}  {name + ' ' + one['device']:<18}{1e3 * seconds:>9.2f}  {ratio:>7.3f}  {target}")
    print(f"replicas agree after training: max |Δw| = {two['max_weight_difference']:.2e}")
    if args.json:
        summary = {"two_ranks": two_ratio, "one_rank": one_ratio}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ratios": summary, "two_ranks": two, "one_rank": one}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
