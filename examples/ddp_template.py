"""A plain PyTorch DDP training script: no meshwise import, only torchrun's environment contract.

Runs unchanged under any launcher that sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT:

    meshwise run -n 2 examples/ddp_template.py --steps 3
    torchrun --nproc-per-node 2 examples/ddp_template.py --steps 3
    meshwise run --print-sbatch --nnodes 2 -np 4 examples/ddp_template.py > job.sbatch; sbatch job.sbatch

The points the template exists to show (each a common multi-GPU bug when missed):
- rank is global, local_rank indexes the GPUs of *this* node; they differ on every node but the first;
- the GPU is bound (``set_device``) *before* ``init_process_group``, so NCCL never opens contexts on GPU 0
  for every rank;
- DistributedSampler gives each rank a disjoint shard, and ``set_epoch`` reshuffles it per epoch;
- a finite timeout turns a dead peer into an error instead of a 30-minute hang;
- ``destroy_process_group`` at the end, after a barrier, and with nothing left holding the group.
At the end, every rank checks that its parameters equal rank 0's: DDP's gradient all-reduce keeps them so.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

# Before init_process_group: DDP imports this lazily, and imported after init its default arguments
# (group=group.WORLD) keep the process group alive past destroy_process_group(); gloo's threads then
# race the interpreter's exit and can abort a finished run ("terminate called without an active exception").
import torch.distributed.nn
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def setup() -> tuple[int, int, int, torch.device]:
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # before init_process_group
        dist.init_process_group(
            "nccl", timeout=datetime.timedelta(seconds=120), device_id=device
        )  # env:// rendezvous
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    return rank, local_rank, world_size, device


def synthetic_data(samples: int, seed: int = 0) -> TensorDataset:
    """A fixed regression problem: identical on every rank, so the sampler alone decides the shards."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, 6, generator=generator)
    targets = inputs @ torch.randn(6, 2, generator=generator) + 0.1 * torch.randn(
        samples, 2, generator=generator
    )
    return TensorDataset(inputs, targets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps in total")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    rank, local_rank, world_size, device = setup()
    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2)).to(device),
        device_ids=[local_rank] if device.type == "cuda" else None,
    )
    dataset = synthetic_data(1024)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        for inputs, targets in loader:
            inputs, targets = inputs.to(device), targets.to(device)
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(inputs), targets)
            loss.backward()  # DDP all-reduces (averages) the gradients here
            optimizer.step()
            step += 1
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss)
            if rank == 0:
                print(f"step {step} loss {mean_loss.item() / world_size:.4f}", flush=True)
            if step == args.steps:
                break
        epoch += 1

    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    in_sync = bool(torch.equal(flat, reference))
    print(
        f"rank {rank}/{world_size} local_rank {local_rank} on {device}: trained {step} steps, "
        f"parameters {'in sync' if in_sync else 'DIVERGED'}",
        flush=True,
    )
    # Tear down in order: DDP's reducer holds the process group, so release it first, and let every rank
    # arrive before any destroys the group (a peer still talking to a destroyed group aborts at exit).
    del model, optimizer
    dist.barrier()
    dist.destroy_process_group()
    if not in_sync:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
