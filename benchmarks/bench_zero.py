"""ZeRO stages vs torch FSDP2 and our DataParallel, side by side in one run: step time and memory.

The model is ``gpt-nano`` (10.7M parameters, 6 blocks of width 384), trained with AdamW on the same
token batch on 2 ranks. The same processes build every configuration from the same initial weights:

- ``fsdp2/gloo``: torch's ``fully_shard`` on every block and on the root, over gloo (the baseline);
- ``zero3/gloo`` and ``zero3/shm``: our stage 3 (units = the blocks) over gloo and shared memory;
- ``ddp/gloo``, ``zero1/gloo``, ``zero2/gloo``: DataParallel and stages 1/2 (their baseline is DDP).

Each round times ``--steps`` consecutive steps of every configuration in turn (the order rotates each
round, so a busy machine's noise hits them alike); a step's time is the slowest rank's. The table gives
medians over rounds and the median of per-round ratios. Memory is accounted tensor bytes per rank
(parameters, gradients, optimizer state held between steps, plus the peak of gathered buffers for our
stages); FSDP2's is counted from its local shards and optimizer state the same way. ``--rss`` adds
the resident-memory growth (VmHWM after 2 steps minus before building the model) of each configuration
alone in fresh processes.

    python benchmarks/bench_zero.py --json benchmarks/results/bench_zero.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch_baselines import fully_shard_blocks, language_model_stepper

import meshwise
from meshwise.comm.shm import ShmCommunicator
from meshwise.models.gpt import CONFIGS, GPT, language_model_loss
from meshwise.parallel import DataParallel
from meshwise.parallel.zero import shard
from meshwise.runtime.memory import peak_resident_bytes
from meshwise.runtime.spawn import spawn

#: step time at most this ratio to the named baseline
TARGETS = {"zero3/gloo": ("fsdp2/gloo", 1.0), "zero3/shm": ("fsdp2/gloo", 0.75),
           "zero1/gloo": ("ddp/gloo", 1.05), "zero2/gloo": ("ddp/gloo", 1.05)}  # fmt: skip
NAMES = ("fsdp2/gloo", "zero3/gloo", "zero3/shm", "ddp/gloo", "zero1/gloo", "zero2/gloo")


def _gpt(config: str) -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIGS[config])


def _build(name: str, config: str, comms: dict) -> tuple[nn.Module, torch.optim.Optimizer]:
    model: nn.Module = _gpt(config)
    if name == "fsdp2/gloo":
        from torch.distributed.device_mesh import init_device_mesh

        fully_shard_blocks(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    elif name == "ddp/gloo":
        model = DataParallel(model, comms["gloo"])
    else:
        stage, backend = int(name[4]), name.split("/")[1]
        units = list(model.blocks) if stage == 3 else None  # the blocks, as FSDP2 above
        model = shard(model, comms[backend], stage=stage, units=units)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _tokens(config: str, batch: int, seq: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rank)
    return torch.randint(0, CONFIGS[config].vocab, (batch, seq + 1), generator=generator)


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def _accounted(name: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Per-rank tensor bytes held between steps (and our peak of gathered buffers)."""
    if name == "fsdp2/gloo" or name == "ddp/gloo":

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if hasattr(t, "to_local") else t

        params = list(model.parameters())
        state = sum(local(v).numel() * v.element_size() for p in params
                    for v in optimizer.state.get(p, {}).values()
                    if isinstance(v, torch.Tensor) and v.numel() == p.numel())  # fmt: skip
        p_bytes = sum(local(p).numel() * p.element_size() for p in params)
        g_bytes = sum(local(p.grad).numel() * p.element_size() for p in params if p.grad is not None)
        if name == "ddp/gloo":  # DDP's gradients are views into its buckets: count the buckets
            g_bytes = sum(b.nbytes for b in model.buckets)
        return {"parameters": p_bytes, "gradients": g_bytes, "optimizer_state": state, "peak_gathered": -1}
    report = model.memory_report(optimizer)
    return {"parameters": report.parameters, "gradients": report.gradients,
            "optimizer_state": report.optimizer_state, "peak_gathered": report.peak_gathered}  # fmt: skip


def _full_weights(name: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """Every (distinct) parameter, whole, by name (collective for the sharded configurations)."""
    if name == "fsdp2/gloo":
        return {n: p.full_tensor() for n, p in model.named_parameters()}
    if name == "ddp/gloo":
        return {n: p.detach() for n, p in model.module.named_parameters()}
    return model.state_dict()


def _two_ranks(config: str, batch: int, seq: int, rounds: int, steps: int, warmup: int) -> dict:
    world = meshwise.init("gloo", device="cpu", timeout=600)
    comms = {"gloo": world.comm, "shm": ShmCommunicator.from_process_group(None, timeout=600)}
    tokens = _tokens(config, batch, seq, world.rank)
    built = {name: _build(name, config, comms) for name in NAMES}
    steppers = {
        name: language_model_stepper(model, opt, language_model_loss, tokens)
        for name, (model, opt) in built.items()
    }
    for name in NAMES:
        for _ in range(warmup):
            steppers[name]()
    for model, _ in built.values():
        if hasattr(model, "tracker"):
            model.tracker.reset_peak()
    samples: dict[str, list[float]] = {name: [] for name in NAMES}
    for r in range(rounds):
        for name in NAMES[r % len(NAMES) :] + NAMES[: r % len(NAMES)]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                steppers[name]()
            samples[name].append(_slowest(time.perf_counter() - start) / steps)
    memory = {name: _accounted(name, model, opt) for name, (model, opt) in built.items()}
    reference = _full_weights("ddp/gloo", built["ddp/gloo"][0])
    agreement = {
        name: max((weights[n] - w).abs().max().item() for n, w in reference.items())
        for name, weights in ((name, _full_weights(name, model)) for name, (model, _) in built.items())
    }
    del built, steppers  # FSDP2 and DDP hold the process group: release them before shutdown
    comms["shm"].close()
    meshwise.shutdown()
    return {"samples": samples, "memory": memory, "max_weight_difference_vs_ddp": agreement}


def _rss_one(name: str, config: str, batch: int, seq: int) -> int:
    """Peak resident-memory growth of one configuration built and stepped twice in a fresh process."""
    world = meshwise.init("gloo", device="cpu", timeout=600)
    comms = {"gloo": world.comm}
    if name.endswith("shm"):
        comms["shm"] = ShmCommunicator.from_process_group(None, timeout=600)
    before = peak_resident_bytes() or 0
    model, opt = _build(name, config, comms)
    step = language_model_stepper(model, opt, language_model_loss, _tokens(config, batch, seq, world.rank))
    for _ in range(2):
        step()
    grown = (peak_resident_bytes() or 0) - before
    del model, opt, step
    if "shm" in comms:
        comms["shm"].close()
    meshwise.shutdown()
    return grown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", default="gpt-nano", choices=list(CONFIGS), help="GPT size (default gpt-nano)"
    )
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per step (default 2)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per configuration")
    parser.add_argument("--steps", type=int, default=2, help="steps per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per configuration first")
    parser.add_argument("--rss", action="store_true", help="also measure each configuration's RSS growth")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    job = (args.config, args.batch, args.seq, args.rounds, args.steps, args.warmup)
    result = spawn(_two_ranks, 2, args=job, timeout=3600)[0]
    samples = result["samples"]
    rss = {}
    if args.rss:
        rss = {name: spawn(_rss_one, 2, args=(name, args.config, args.batch, args.seq), timeout=1800)[0]
               for name in NAMES}  # fmt: skip
    params = CONFIGS[args.config].num_parameters()
    print(f"{args.config} ({params / 1e6:.1f}M params), batch {args.batch}×{args.seq} tokens/rank, AdamW, "
          f"2 ranks; medians of {args.rounds} rounds × {args.steps} steps")  # fmt: skip
    print(f"{'configuration':<13}{'step ms':>9}  {'ratio':>14}  {'target':<8}{'state MiB':>10}"
          f"{'peak gath.':>11}{'RSS+ MiB':>9}  {'max|Δw| vs ddp':>14}")  # fmt: skip
    ratios = {}
    for name in NAMES:
        base, target = TARGETS.get(name, (name, None))  # the baselines are their own reference
        ratio = statistics.median(t / b for t, b in zip(samples[name], samples[base], strict=True))
        ratios[name] = {"baseline": base, "ratio": ratio, "target": target}
        verdict = "" if target is None else ("ok" if ratio <= target else "MISSED")
        mem = result["memory"][name]
        state = (mem["parameters"] + mem["gradients"] + mem["optimizer_state"]) / 2**20
        peak = "" if mem["peak_gathered"] < 0 else f"{mem['peak_gathered'] / 2**20:.1f}"
        grown = f"{rss[name] / 2**20:.0f}" if name in rss else ""
        median_ms = 1e3 * statistics.median(samples[name])
        print(f"{name:<13}{median_ms:>9.1f}  {ratio:>5.3f} vs {base.split('/')[0]:<5}"
              f"  {('≤ ' + str(target)) if target else '':<6}{verdict:<3}{state:>9.1f}{peak:>11}{grown:>9}"
              f"  {result['max_weight_difference_vs_ddp'][name]:>14.2e}")  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        out = {"args": vars(args), "ratios": ratios, "rss_growth": rss, **result}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
