"""Tensor parallelism vs torch DTensor ``parallelize_module``, and activation memory with and without SP.

**Step time.** The same GPT (4 layers, hidden 256, 8 heads, sequence 128, vocabulary 256), the same batch,
AdamW, on 2 ranks, side by side in one run:

- ``dtensor/gloo``: torch's ``parallelize_module`` with ``ColwiseParallel`` on attention's q/k/v and the
  MLP's fc and ``RowwiseParallel`` on attention's out and the MLP's proj (the layers meshwise splits),
  on the gloo process group; the embedding and the tied head stay replicated (DTensor cannot shard a
  tied weight by rows in one plan), so its loss is ``F.cross_entropy`` of full logits;
- ``meshwise/gloo``: ``tensor_parallel(gpt, comm)`` on a Communicator over the same gloo group;
- ``meshwise/gloo+sp``: the same with sequence parallelism;
- ``meshwise/shm`` and ``meshwise/shm+sp``: on the shared-memory transport.

Each round times ``--steps`` consecutive steps of each configuration in turn (the order rotates every
round); a step's time is the slowest rank's. The table reports medians over rounds and the median of
the per-round ratios to ``dtensor/gloo``. Every configuration trains from the same weights on the same
batch, so their losses after training must agree (last line).

**Activation memory.** Bytes of the tensors one transformer layer saves for backward (saved-tensor hooks,
parameters excluded, each storage counted once) in training mode with dropout 0.1, for one process, TP
and TP + SP, against the formula for our layer derived in docs/tensor_parallel.md from Megatron's
``sbh(34 + 5as/h)``: ``sbh(16v + 2m) + as²b(2v + m)`` bytes for v bytes per value and m per dropout-mask
element; TP keeps ``sbh(4v + 2m)`` of it replicated, TP + SP divides all of it by t.

    python benchmarks/bench_tensor.py --json benchmarks/results/tensor.json
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from bench_ddp import _medians, _paired_ratios, _time_rounds
from torch import nn
from torch_baselines import dtensor_tensor_parallel, language_model_stepper

import meshwise
from meshwise.comm.shm import ShmCommunicator
from meshwise.models.gpt import GPT, GPTConfig, language_model_loss
from meshwise.models.gpt_activations import layer_activation_report
from meshwise.models.gpt_plan import tensor_parallel
from meshwise.parallel.tensor_parallel import vocab_parallel_cross_entropy
from meshwise.runtime.spawn import spawn

TARGETS = {"meshwise/gloo": 1.0, "meshwise/shm": 0.7}  # step time vs dtensor/gloo, at most
MEMORY_TOLERANCE = 0.10  # measured activation bytes within 10 % of the formula


def _step_times(config: GPTConfig, batch: int, rounds: int, steps: int, warmup: int) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh  # a few seconds that only the ranks need

    world = meshwise.init("gloo", device="cpu", timeout=300)
    shm = ShmCommunicator.from_process_group(None, timeout=300)
    torch.manual_seed(0)
    reference = GPT(config)
    tokens = torch.randint(
        0, config.vocab, (batch, config.seq_len + 1), generator=torch.Generator().manual_seed(1)
    )
    tp_mesh = init_device_mesh("cpu", (world.world_size,))
    models: dict[str, tuple[nn.Module, Callable]] = {
        "dtensor/gloo": (dtensor_tensor_parallel(copy.deepcopy(reference), tp_mesh), language_model_loss)
    }
    for name, comm in (("gloo", world.comm), ("shm", shm)):
        for sp in (False, True):

            def loss(logits: torch.Tensor, targets: torch.Tensor, comm=comm) -> torch.Tensor:
                return vocab_parallel_cross_entropy(logits, targets, comm, vocab=config.vocab)

            model = tensor_parallel(copy.deepcopy(reference), comm, sequence_parallel=sp)
            models[f"meshwise/{name}{'+sp' if sp else ''}"] = (model, loss)
    steppers = {
        name: language_model_stepper(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss, tokens)
        for name, (model, loss) in models.items()
    }
    samples = _time_rounds(steppers, rounds, steps, warmup, dist.barrier)
    with torch.no_grad():
        losses = {
            name: loss(model(tokens[:, :-1]), tokens[:, 1:]).item() for name, (model, loss) in models.items()
        }
    memory = layer_activation_report(replace(config, dropout=0.1), world.comm, batch=4)
    del models, steppers
    shm.close()
    meshwise.shutdown()
    return {"samples": samples, "losses": losses, "memory": memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per configuration")
    parser.add_argument("--steps", type=int, default=2, help="steps per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration first")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    config = GPTConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, seq_len=args.seq_len)
    result = spawn(
        _step_times, 2, args=(config, args.batch, args.rounds, args.steps, args.warmup), timeout=3600
    )[0]
    medians, ratios = _medians(result["samples"]), _paired_ratios(result["samples"], "dtensor/gloo")

    print(
        f"GPT {config.layers}×{config.hidden} ({config.heads} heads), seq {config.seq_len}, "
        f"batch {args.batch}, AdamW, 2 ranks; medians of {args.rounds} rounds × {args.steps} steps"
    )
    print(f"{'configuration':<18}{'step ms':>9}  {'ratio':>7}  target")
    for name, seconds in medians.items():
        target = TARGETS.get(name)
        verdict = (
            "" if target is None else f"≤ {target:.2f}" + (" ok" if ratios[name] <= target else " MISSED")
        )
        print(f"{name:<18}{1e3 * seconds:>9.2f}  {ratios[name]:>7.3f}  {verdict or 'vs dtensor/gloo'}")
    spread = max(result["losses"].values()) - min(result["losses"].values())
    print(f"losses after training agree: max - min = {spread:.2e}")
    print("\nactivations saved by one layer (training, dropout 0.1), per rank")
    print(f"{'configuration':<14}{'measured KiB':>14}{'formula KiB':>13}{'ratio':>8}")
    for name, row in result["memory"].items():
        verdict = "ok" if abs(row["ratio"] - 1) <= MEMORY_TOLERANCE else "MISSED"
        kib = f"{row['measured'] / 1024:>14.1f}{row['formula'] / 1024:>13.1f}"
        print(f"{name:<14}{kib}{row['ratio']:>8.3f}  {verdict}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "medians": medians, "ratios": ratios, **result}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
