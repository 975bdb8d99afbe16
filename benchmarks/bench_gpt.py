"""GPT training step: ours vs plain torch.nn on one process, and our data parallelism vs torch DDP on 2.

1. One process: a training step (forward, loss, backward, AdamW) of our ``GPT`` against the same
   architecture assembled from stock torch layers — ``nn.TransformerEncoderLayer`` (pre-LayerNorm,
   causal, tanh-GELU, fused in-projection) between the same embeddings and tied head — loaded with the
   same weights (the script checks the two give the same logits first). Target: ours ≤ 1.02× plain.
2. Two ranks: our data-parallel step (``parallelize`` → DataParallel over the shared-memory mesh) against
   ``torch.nn.parallel.DistributedDataParallel`` on gloo, same model and per-rank batch. Target ≤ 0.8×.
   The same rounds also time a third replica stepped with no communication at all ("compute only"): the
   floor of any 2-rank step, so its ratio to DDP says how far below DDP a data-parallel step can get on
   this machine. Both ranks run one torch thread each (the cores shared out, as every launcher here
   does), on all three sides; rank 0's median forward / backward / optimizer times show where the time
   goes (backward includes the communication it waits for).

Each round times ``--steps`` steps of every configuration back to back (order rotating per round); the
table reports median step times and the median of the per-round ratios, which cancels most of the drift
of a busy machine (bench_ddp.py's method and helpers).

    python benchmarks/bench_gpt.py --json benchmarks/results/gpt.json
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
import torch.nn.functional as F
from bench_ddp import _medians, _paired_ratios, _time_rounds
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import meshwise
from meshwise.comm.mesh import MeshShape
from meshwise.models.gpt import GPT, GPTConfig, gpt_config, language_model_loss
from meshwise.runtime.spawn import spawn
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.parallelize import build_optimizer, parallelize
from meshwise.train.gpt.resolve import resolve

TARGETS = {"one process: ours / plain torch.nn": 1.02, "2 ranks: ours on shm / torch DDP on gloo": 0.80}
#: the 2-rank configurations, timed in the same rounds
LABELS = ("torch DDP/gloo", "ours/shm", "ours/shm, mid-backward", "compute only")
PHASES = ("forward", "backward", "optimizer")
INFO = {
    "2 ranks: compute only / torch DDP on gloo": "floor: no step can be faster",
    "2 ranks: ours, mid-backward launch / DDP": "before: buckets launched during backward",
}


class PlainGPT(nn.Module):
    """GPT-2 from stock layers: what a user would write without meshwise's model."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab, config.hidden)
        self.wpe = nn.Embedding(config.seq_len, config.hidden)
        layer = nn.TransformerEncoderLayer(
            config.hidden, config.heads, 4 * config.hidden, dropout=0.0,
            activation=lambda x: F.gelu(x, approximate="tanh"), batch_first=True, norm_first=True,
        )  # fmt: skip
        self.blocks = nn.TransformerEncoder(layer, config.layers, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(config.hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        x = self.wte(tokens) + self.wpe(torch.arange(seq, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=tokens.device)
        x = self.blocks(x, mask=mask, is_causal=True)
        return self.ln_f(x) @ self.wte.weight.t()

    @torch.no_grad()
    def load_from(self, ours: GPT) -> None:
        for name in ("wte", "wpe", "ln_f"):
            getattr(self, name).load_state_dict(getattr(ours, name).state_dict())
        for layer, block in zip(self.blocks.layers, ours.blocks, strict=True):
            attn = block.attn
            layer.self_attn.in_proj_weight.copy_(torch.cat([attn.q.weight, attn.k.weight, attn.v.weight]))
            layer.self_attn.in_proj_bias.copy_(torch.cat([attn.q.bias, attn.k.bias, attn.v.bias]))
            layer.self_attn.out_proj.load_state_dict(attn.out.state_dict())
            layer.linear1.load_state_dict(block.mlp.fc.state_dict())
            layer.linear2.load_state_dict(block.mlp.proj.state_dict())
            layer.norm1.load_state_dict(block.ln1.state_dict())
            layer.norm2.load_state_dict(block.ln2.state_dict())


def _batch(config: GPTConfig, batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, config.vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))
    return data[:, :-1], data[:, 1:]


def _stepper(
    model: nn.Module, optimizer: torch.optim.Optimizer, x, y, phases: dict[str, list[float]] | None = None
) -> Callable[[], None]:
    """One training step; with ``phases``, the seconds of its forward, backward and optimizer parts are
    appended there (backward includes whatever communication it waits for)."""

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        began = time.perf_counter()
        loss = language_model_loss(model(x), y)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        optimizer.step()
        if phases is not None:
            ended = (forward - began, backward - forward, time.perf_counter() - backward)
            for name, seconds in zip(PHASES, ended, strict=True):
                phases[name].append(seconds)

    return step


def _one_process(name: str, batch: int, seq: int, rounds: int, steps: int, warmup: int) -> dict:
    config = gpt_config(name)
    torch.manual_seed(0)
    ours = GPT(config)
    plain = PlainGPT(config)
    plain.load_from(ours)
    x, y = _batch(config, batch, seq, 0)
    with torch.no_grad():
        agree = (ours(x) - plain(x)).abs().max().item()
    train = GPTTrainConfig.from_flags(config=name)
    steppers = {
        "plain": _stepper(plain, build_optimizer(plain, train.optimizer), x, y),
        "ours": _stepper(ours, build_optimizer(ours, train.optimizer), x, y),
    }
    samples = _time_rounds(steppers, rounds, steps, warmup, lambda: None)
    return {"samples": samples, "max_logit_difference": agree, "threads": torch.get_num_threads()}


def _two_ranks(name: str, batch: int, seq: int, rounds: int, steps: int, warmup: int) -> dict:
    world = meshwise.init("shm", timeout=300, mesh=MeshShape(dp=2))
    config = gpt_config(name)
    train = GPTTrainConfig.from_flags(config=name)
    x, y = _batch(config, batch, seq, world.rank)
    models = {}
    for label in LABELS:
        torch.manual_seed(0)
        models[label] = GPT(config)
    run = resolve(train)
    runner = parallelize(models["ours/shm"], world.mesh, run)
    # A/B of the reducer's choice: the same DataParallel launching each bucket as soon as it is complete
    # (as over gloo), although the shm all-reduce blocks backward until the peer arrives
    eager = parallelize(models["ours/shm, mid-backward"], world.mesh, run)
    (reducer,) = eager.model._reducers
    reducer._launch_during_backward = True
    wrapped = {
        "torch DDP/gloo": DistributedDataParallel(models["torch DDP/gloo"]),
        "ours/shm": runner.model,
        "ours/shm, mid-backward": eager.model,
        "compute only": models["compute only"],  # no communication: the floor of any 2-rank step
    }
    optimizers = {label: build_optimizer(models[label], train.optimizer) for label in LABELS}
    optimizers["ours/shm"], optimizers["ours/shm, mid-backward"] = runner.optimizer, eager.optimizer
    phases = {label: {phase: [] for phase in PHASES} for label in LABELS}
    steppers = {label: _stepper(wrapped[label], optimizers[label], x, y, phases[label]) for label in LABELS}
    samples = _time_rounds(steppers, rounds, steps, warmup, dist.barrier)
    disagreement = max(  # the compute-only replica averaged nothing: it is not expected to agree
        (p - q).abs().max().item()
        for label in ("ours/shm", "ours/shm, mid-backward")
        for p, q in zip(models[label].parameters(), models["torch DDP/gloo"].parameters(), strict=True)
    )
    del wrapped, steppers  # torch's DDP holds the process group: release it before shutdown
    meshwise.shutdown()
    timed = {  # the warmup steps are not timed: drop them
        label: {phase: values[warmup:] for phase, values in by_phase.items()}
        for label, by_phase in phases.items()
    }
    return {"samples": samples, "phases": timed, "max_weight_difference": disagreement,
            "threads": torch.get_num_threads()}  # fmt: skip


def _phase_table(phases: dict[str, dict[str, list[float]]]) -> None:
    """Rank 0's median milliseconds per phase of each 2-rank configuration."""
    print(f"rank 0 phases, median ms {''.join(f'{phase:>10}' for phase in PHASES)}")
    for label, by_phase in phases.items():
        cells = "".join(f"{1e3 * statistics.median(by_phase[phase]):>10.1f}" for phase in PHASES)
        print(f"  {label:<26}{cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="gpt-nano", help="model (default gpt-nano)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per step (default 2)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds per configuration")
    parser.add_argument("--steps", type=int, default=2, help="steps per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration first")
    parser.add_argument("--part", choices=("all", "one", "two"), default="all", help="which comparisons")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    job = (args.config, args.batch, args.seq_len, args.rounds, args.steps, args.warmup)
    one = spawn(_one_process, 1, args=job, timeout=3600)[0] if args.part in ("all", "one") else None
    two = spawn(_two_ranks, 2, args=job, timeout=3600)[0] if args.part in ("all", "two") else None
    rows = {
        "one process: ours / plain torch.nn": (one, "ours", "plain"),
        "2 ranks: ours on shm / torch DDP on gloo": (two, "ours/shm", "torch DDP/gloo"),
        "2 ranks: compute only / torch DDP on gloo": (two, "compute only", "torch DDP/gloo"),
        "2 ranks: ours, mid-backward launch / DDP": (two, "ours/shm, mid-backward", "torch DDP/gloo"),
    }
    print(f"{args.config}, {args.batch} × {args.seq_len} tokens per rank per step, AdamW; "
          f"medians of {args.rounds} rounds × {args.steps} steps")  # fmt: skip
    print(f"{'comparison':<44}{'ours ms':>10}{'base ms':>10}{'ratio':>8}  target")
    ratios = {}
    for label, (result, ours, base) in rows.items():
        if result is None:
            continue
        medians, ratio = _medians(result["samples"]), _paired_ratios(result["samples"], base)[ours]
        ratios[label] = ratio
        target = TARGETS.get(label)
        verdict = INFO.get(label, "") if target is None else (
            f"≤ {target:.2f} {'ok' if ratio <= target else 'MISSED'}")  # fmt: skip
        print(f"{label:<44}{1e3 * medians[ours]:>10.1f}{1e3 * medians[base]:>10.1f}{ratio:>8.3f}  {verdict}")
    if one is not None:
        print(f"same logits as plain torch.nn: max |Δ| = {one['max_logit_difference']:.2e}")
    if two is not None:
        print(f"DDP and ours agree after training: max |Δw| = {two['max_weight_difference']:.2e}; "
              f"{two['threads']} torch thread(s) per rank on both sides")  # fmt: skip
        _phase_table(two["phases"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        data = {"args": vars(args), "ratios": ratios, "one_process": one, "two_ranks": two}
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
