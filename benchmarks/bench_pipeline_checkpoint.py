"""``train gpt --pp`` checkpoints and ``--sample`` on 2 ranks: what a pipeline checkpoint costs next to a
data-parallel one, and whether it is the same checkpoint.

In one run the same two processes train one step of the same GPT as dp 2 and as pp 2 (1F1B), then,
``--rounds`` times, for each layout (alternating which goes first; each checkpoint is deleted after its
round): save a DCP checkpoint (``meshwise.train.checkpoint.save``, as the loop does), load it into a
fresh step runner of each layout, as ``--resume`` does, and compare every weight and AdamW slot with the
saver's. At the end the pp stages are gathered into a plain GPT once (what ``--sample`` does).
Reported: bytes on disk (the tied embedding/head is written once, so both layouts should write the same
bytes), median save / load seconds and the gather seconds (the slower rank), and the largest difference
of a weight or AdamW slot after a load (0 when the layouts agree on every name).

    python benchmarks/bench_pipeline_checkpoint.py --json benchmarks/results/pipeline_checkpoint.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import meshwise
from meshwise.comm.api import ReduceOp
from meshwise.comm.mesh import Mesh, MeshShape
from meshwise.models.gpt import CONFIGS, GPT
from meshwise.runtime.spawn import spawn
from meshwise.train import checkpoint
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.parallelize import parallelize
from meshwise.train.gpt.resolve import resolve
from meshwise.train.step import ParallelStep

LAYOUTS = {"dp": MeshShape(dp=2), "pp": MeshShape(pp=2)}


def _slowest(comm, seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    comm.all_reduce(value, ReduceOp.MAX)
    return value.item()


def _runner(name: str, meshes: dict[str, Mesh], config_name: str, batch: int) -> ParallelStep:
    """The GPT loop's step runner for layout ``name``: a step is 4 micro-batches of ``batch`` sequences."""
    micro_batches = 4 // meshes[name].shape.dp  # a global batch of 4 micro-batches
    config = GPTTrainConfig.from_flags(
        config=config_name,
        nproc=2,
        pp=LAYOUTS[name].pp,
        global_batch=2 * batch * 2,
        micro_batches=micro_batches,
    )
    torch.manual_seed(0)
    return parallelize(GPT(CONFIGS[config_name]), meshes[name], resolve(config))


def _tensors(runner: ParallelStep) -> dict[str, torch.Tensor]:
    """Weights and AdamW slots this rank holds, by plain name."""
    state = runner.state_dict()
    out = {k: v.detach().clone() for k, v in state["model"].items()}
    for name, slots in state["optim"]["state"].items():
        out |= {f"{name}:{slot}": value.clone() for slot, value in slots.items()}
    return out


def _timed(world: meshwise.World, work: Callable[..., object], *args: object, **kwargs: object) -> float:
    """Seconds of ``work(*args, **kwargs)`` on the slower rank, started together."""
    world.comm.barrier()
    started = time.perf_counter()
    work(*args, **kwargs)
    return _slowest(world.comm, time.perf_counter() - started)


def _load(loader: ParallelStep, directory: Path) -> None:
    """What ``--resume`` does: fill the runner's own state template from the checkpoint, then apply it."""
    template = loader.state_dict()
    run = checkpoint.read_run(directory, checkpoint.GPT_READS, "GPT ")
    dcp.load(template, checkpoint_id=str(checkpoint.step_dir(directory, run["step"])))
    loader.load_state_dict(template)


def _two_ranks(config_name: str, batch: int, seq: int, rounds: int, root: str) -> dict:
    world = meshwise.init("gloo", timeout=600)
    try:
        meshes = {name: Mesh(world.comm, shape) for name, shape in LAYOUTS.items()}
        generator = torch.Generator().manual_seed(1)
        vocab = CONFIGS[config_name].vocab
        tokens = torch.randint(0, vocab, (4 * batch, seq + 1), generator=generator)  # the global batch
        runners, ours = {}, {}
        for name in LAYOUTS:
            runner = runners[name] = _runner(name, meshes, config_name, batch)
            dp_rank = meshes[name].coordinates["dp"]
            mine = tokens.chunk(meshes[name].shape.dp)[dp_rank]
            runner.forward_backward([(x[:, :-1], x[:, 1:]) for x in mine.split(batch)])
            runner.optimizer.step()  # AdamW state exists, as at any real checkpoint
            ours[name] = _tensors(runner)
        times = {name: {"save": [], **{f"load into {n}": [] for n in LAYOUTS}} for name in LAYOUTS}
        difference, size = dict.fromkeys(LAYOUTS, 0.0), {}
        for r in range(rounds):
            order = list(LAYOUTS)[r % 2 :] + list(LAYOUTS)[: r % 2]  # alternate who goes first
            for name in order:
                target = Path(root) / f"{name}-{r}"
                state = runners[name].state_dict()
                times[name]["save"].append(
                    _timed(world, checkpoint.save, target, 1, state, {}, format=checkpoint.GPT_FORMAT,
                           is_main=world.is_main, barrier=world.comm.barrier)
                )  # fmt: skip
                for into in LAYOUTS:
                    loader = _runner(into, meshes, config_name, batch)
                    times[name][f"load into {into}"].append(_timed(world, _load, loader, target))
                    theirs = _tensors(loader)
                    common = ours[name].keys() & theirs.keys()
                    mine = max((theirs[k] - ours[name][k]).abs().max().item() for k in common)
                    difference[name] = max(difference[name], _slowest(world.comm, mine))
                size[name] = sum(f.stat().st_size for f in (target / "step-000001").rglob("*") if f.is_file())
                world.comm.barrier()
                if world.is_main:  # written-back pages of old rounds must not slow the next save
                    shutil.rmtree(target)
        gather = _timed(world, runners["pp"].sampling_model)
        out = {
            name: {
                "bytes": size[name],
                **{f"{what}_s": statistics.median(values) for what, values in times[name].items()},
                "gather_s": gather if name == "pp" else None,
                "max_difference": difference[name],
            }
            for name in LAYOUTS
        }
        for mesh in meshes.values():
            mesh.close()
        return out
    finally:
        meshwise.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", default="gpt-nano", choices=list(CONFIGS), help="GPT size (default gpt-nano)"
    )
    parser.add_argument("--batch", type=int, default=2, help="sequences per micro-batch (default 2)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--rounds", type=int, default=3, help="timed save/load rounds per layout")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-pp-checkpoint-") as root:
        job = (args.config, args.batch, args.seq, args.rounds, root)
        result = spawn(_two_ranks, 2, args=job, timeout=1800)[0]
    params = CONFIGS[args.config].num_parameters()
    print(
        f"{args.config} ({params / 1e6:.1f}M params) with AdamW state, 2 ranks on gloo; "
        f"medians of {args.rounds} rounds"
    )
    print(f"{'saved by':<9}{'MiB on disk':>12}{'save s':>9}{'load into dp s':>16}{'load into pp s':>16}"
          f"{'gather s':>10}{'max|Δ|':>9}")  # fmt: skip
    for name, row in result.items():
        gather = "" if row["gather_s"] is None else f"{row['gather_s']:.3f}"
        print(f"{name:<9}{row['bytes'] / 2**20:>12.1f}{row['save_s']:>9.3f}{row['load into dp_s']:>16.3f}"
              f"{row['load into pp_s']:>16.3f}{gather:>10}{row['max_difference']:>9.1e}")  # fmt: skip
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "layouts": result}, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
