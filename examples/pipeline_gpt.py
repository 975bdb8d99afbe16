"""Train a small GPT with pipeline parallelism (optionally × data parallelism) and draw its timeline.

    meshwise run -np 2 examples/pipeline_gpt.py --schedule 1f1b --micro-batches 8 --timeline pp.png
    meshwise run -np 4 examples/pipeline_gpt.py --pp 2 --schedule zb --trace pp.json   # pp 2 × dp 2
    meshwise run -np 2 examples/pipeline_gpt.py --schedule interleaved --virtual-stages 2 --config gpt-nano

The text is this file itself, read as bytes (vocabulary 256), so the loss visibly falls within a few dozen
steps. Every rank builds the same model from the same seed and keeps only its chunks. The last step's
timeline (every rank's F/B/W instructions) is gathered on rank 0 and written as a Chrome/Perfetto trace
(``--trace``, open in ui.perfetto.dev) and/or a PNG diagram (``--timeline``) with the measured bubble next
to the theory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import meshwise
from meshwise.comm.mesh import Mesh, MeshShape
from meshwise.models.gpt import GPT, gpt_config
from meshwise.models.gpt_plan import gpt_plan
from meshwise.parallel.pipeline_parallel import SCHEDULES, chunk_parameters, theoretical_bubble
from meshwise.parallel.pipeline_parallel.builder import build_pipeline, micro_batches_of, validate_pipeline
from meshwise.parallel.pipeline_parallel.timeline import draw, gather_events, measured_bubble, write_trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="gpt-tiny", help="named GPT config (default gpt-tiny)")
    parser.add_argument("--pp", type=int, default=None, help="pipeline stages (default: every rank)")
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--virtual-stages", type=int, default=1, help="chunks per rank (interleaved)")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--trace", default=None, help="write the last step as a Chrome trace JSON")
    parser.add_argument("--timeline", default=None, help="draw the last step as a PNG")
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args()

    config = gpt_config(args.config)
    world = meshwise.init(backend=args.backend)
    pp = args.pp or world.world_size
    shape = MeshShape.infer(world.world_size, pp=pp)
    validate_pipeline(config.layers, pp, args.micro_batches, args.schedule, args.virtual_stages)
    mesh = Mesh(world.comm, shape)
    torch.manual_seed(0)
    executor, chunks = build_pipeline(
        GPT(config),
        gpt_plan(config),
        mesh.pp,
        schedule=args.schedule,
        micro_batches=args.micro_batches,
        virtual_stages=args.virtual_stages,
        dp=mesh.dp,
    )
    optimizer = torch.optim.AdamW(chunk_parameters(chunks), lr=args.lr)
    text = torch.frombuffer(bytearray(Path(__file__).read_bytes()), dtype=torch.uint8).long()
    per_replica = args.micro_batch_size * args.micro_batches
    generator = torch.Generator().manual_seed(1234)
    dp_index = mesh.coordinates["dp"]
    for step in range(args.steps):
        starts = torch.randint(
            0, len(text) - config.seq_len - 1, (per_replica * shape.dp,), generator=generator
        )
        window = torch.stack([text[s : s + config.seq_len + 1] for s in starts.tolist()])
        mine = window[dp_index * per_replica : (dp_index + 1) * per_replica]
        optimizer.zero_grad()
        result = executor.step(
            micro_batches_of(mine[:, :-1], args.micro_batches),
            micro_batches_of(mine[:, 1:], args.micro_batches),
        )
        optimizer.step()
        if world.is_main and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:>4}  loss {result.loss:.4f}", flush=True)
    events = gather_events(mesh.pp, result.events)
    if world.is_main and events is not None:
        theory = theoretical_bubble(pp, args.micro_batches, args.virtual_stages)
        print(
            f"last step: bubble measured {measured_bubble(events):.1%}, theory {theory:.1%} "
            f"({args.schedule}, p={pp}, m={args.micro_batches}, v={args.virtual_stages})"
        )
        if args.trace:
            write_trace(events, args.trace)
        if args.timeline:
            draw(events, args.timeline, title=f"{args.schedule} p={pp} m={args.micro_batches}", theory=theory)
    executor.close()
    mesh.close()
    meshwise.shutdown()


if __name__ == "__main__":
    main()
