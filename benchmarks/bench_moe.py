"""A mixture-of-experts GPT step on 2 ranks: experts spread over them (ep2) vs replicated (dp2).

The same MoE GPT (default: 2 layers, hidden 256, 4 heads, sequence 64, 8 experts, top-2, dropless unless
``--capacity-factor``), the same per-rank batch and AdamW, side by side in one run, on each ``--backend``:

- ``dp2``: every rank holds all E experts; after backward one flat all-reduce averages every gradient;
- ``ep2``: ``apply_expert_parallel`` keeps E/2 experts per rank and routes tokens with two all-to-alls
  per layer forward and two backward; ``reduce_gradients`` averages the dense gradients with one flat
  all-reduce and rescales the expert ones (no communication: each expert lives on one rank).

Each round times ``--steps`` consecutive steps of each configuration in turn (order rotating); a step's
time is the slowest rank's. The table gives medians over rounds, tokens/s over both ranks, the per-rank
bytes of model state (fp32 weights + gradients + Adam's two moments = 16 bytes per parameter held, an
exact count), and for ep2 the share of the step spent in the all-to-alls (counts and tokens, forward and
backward), timed around each call on rank 0.

    python benchmarks/bench_moe.py --json benchmarks/results/x29_moe.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_ddp import _medians, _paired_ratios, _time_rounds

import meshwise
from meshwise.comm.api import Communicator, ReduceOp
from meshwise.models.gpt import GPT, GPTConfig, language_model_loss
from meshwise.models.moe import with_auxiliary_losses
from meshwise.parallel.expert_parallel import apply_expert_parallel, check_expert_parallel, reduce_gradients
from meshwise.runtime.spawn import spawn

STATE_BYTES_PER_PARAMETER = 16  # fp32 weight, gradient, Adam m and v


class TimedAllToAll:
    """A Communicator stand-in for the exchange: forwards ``all_to_all_single`` and adds up its seconds."""

    def __init__(self, comm: Communicator) -> None:
        self.comm, self.rank, self.world_size, self.seconds = comm, comm.rank, comm.world_size, 0.0

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None) -> None:
        started = time.perf_counter()
        self.comm.all_to_all_single(output, input, output_split_sizes, input_split_sizes)
        self.seconds += time.perf_counter() - started


def _stepper(model: GPT, comm: Communicator, tokens: torch.Tensor, reduce: Callable[[], None]):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad()
        loss = with_auxiliary_losses(language_model_loss(model(tokens[:, :-1]), tokens[:, 1:]), model)
        loss.backward()
        reduce()
        optimizer.step()

    return step


def _all_reduce_every_gradient(model: GPT, comm: Communicator) -> None:
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    comm.all_reduce(flat, ReduceOp.AVG)
    offset = 0
    for p in model.parameters():
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def _rank(backend: str, config: GPTConfig, batch: int, rounds: int, steps: int, warmup: int) -> dict:
    world = meshwise.init(backend, device="cpu", timeout=600)
    try:
        comm = world.comm
        torch.manual_seed(0)
        replicated = GPT(config)
        timed = TimedAllToAll(comm)
        sharded = apply_expert_parallel(copy.deepcopy(replicated), timed)  # type: ignore[arg-type]
        data = torch.Generator().manual_seed(comm.rank)  # each rank its own shard of the batch
        tokens = torch.randint(0, config.vocab, (batch, config.seq_len + 1), generator=data)
        steppers = {
            "dp2": _stepper(replicated, comm, tokens, lambda: _all_reduce_every_gradient(replicated, comm)),
            "ep2": _stepper(sharded, comm, tokens, lambda: reduce_gradients(sharded, comm)),
        }
        samples = _time_rounds(steppers, rounds, steps, warmup, comm.barrier)
        timed.seconds = 0.0
        started = time.perf_counter()
        for _ in range(steps):
            steppers["ep2"]()
        ep_seconds = time.perf_counter() - started
        return {
            "samples": samples,
            "state_bytes": {
                name: STATE_BYTES_PER_PARAMETER * sum(p.numel() for p in model.parameters())
                for name, model in (("dp2", replicated), ("ep2", sharded))
            },
            "all_to_all_share": timed.seconds / ep_seconds,
        }
    finally:
        meshwise.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=None, help="default: dropless")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default 8)")
    parser.add_argument("--backend", default="gloo,shm", help="comma-separated backends (default gloo,shm)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per configuration")
    parser.add_argument("--steps", type=int, default=3, help="steps per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration first")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    try:
        check_expert_parallel(args.experts, 2)
        config = GPTConfig(
            layers=args.layers, hidden=args.hidden, heads=4, seq_len=args.seq_len, experts=args.experts,
            top_k=args.top_k, capacity_factor=args.capacity_factor,
        ).validate()  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))
    tokens_per_step = 2 * args.batch * args.seq_len
    load = os.getloadavg()
    rows = []
    print(f"MoE GPT step, 2 ranks: {config}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'backend':<8} {'layout':<6} {'step ms':>9} {'tokens/s':>10} {'vs dp2':>7} {'state MiB/rank':>15}"
          f" {'all-to-all share':>17}")  # fmt: skip
    for backend in args.backend.split(","):
        job = (backend, config, args.batch, args.rounds, args.steps, args.warmup)
        ranks = spawn(_rank, 2, args=job, timeout=3600)
        samples = {name: [max(r["samples"][name][i] for r in ranks) for i in range(args.rounds)]
                   for name in ("dp2", "ep2")}  # fmt: skip
        medians, ratios = _medians(samples), _paired_ratios(samples, "dp2")
        for name in ("dp2", "ep2"):
            share = statistics.median(r["all_to_all_share"] for r in ranks) if name == "ep2" else None
            row = {
                "backend": backend,
                "layout": name,
                "step_seconds": medians[name],
                "tokens_per_second": tokens_per_step / medians[name],
                "step_ratio_vs_dp2": ratios[name],
                "state_bytes_per_rank": ranks[0]["state_bytes"][name],
                "all_to_all_share": share,
                "samples": samples[name],
            }
            rows.append(row)
            shown = f"{100 * share:16.1f}%" if share is not None else f"{'-':>17}"
            print(
                f"{backend:<8} {name:<6} {1e3 * medians[name]:9.1f} {row['tokens_per_second']:10,.0f} "
                f"{ratios[name]:7.2f} {row['state_bytes_per_rank'] / 2**20:15.1f} {shown}"
            )
    if args.json:
        result = {"config": vars(args), "model": config.__dict__, "load_average": load, "rows": rows}
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
