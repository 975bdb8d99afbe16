"""One rank of an MPI test job: ``mpirun -n K python tests/mpi_job.py SCENARIO``.

tests/test_mpi.py starts this under mpirun; every rank prints one line ``VERDICT {json}`` that the test
parses, so assertions stay in the test and the job itself only reports what it observed.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import meshwise
from meshwise.comm import CollectiveMismatchError, CommError, CommTimeoutError
from meshwise.comm.native import NativeCommunicator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collective_matrix import check_collectives


def report(payload: object) -> None:
    print("VERDICT " + json.dumps(payload), flush=True)


def matrix() -> None:
    """The whole collective matrix on the mpi backend against gloo over the same ranks."""
    world = meshwise.init("mpi", timeout=60)
    failures = check_collectives(world.comm, NativeCommunicator(timeout=60), sizes=(1, 7, 130))
    report({"rank": world.rank, "failures": failures[:20], "count": len(failures)})
    meshwise.shutdown()


def extras() -> None:
    """Subgroups, async handles, size mismatch, bad input: values computed by hand."""
    world = meshwise.init("mpi", timeout=30)
    comm, rank, n = world.comm, world.rank, world.world_size
    out: dict[str, object] = {"rank": rank}
    evens = comm.split([r for r in range(n) if r % 2 == 0])
    out["even"] = None
    if evens is not None:
        x = torch.tensor([rank + 1], dtype=torch.int64)
        evens.all_reduce(x)
        out["even"] = [evens.rank, evens.world_size, x.item()]
        evens.close()
    reverse = comm.split(list(reversed(range(n))))  # new rank = position in the list
    assert reverse is not None
    gathered = torch.empty(n, dtype=torch.int64)
    reverse.all_gather(gathered, torch.tensor([rank], dtype=torch.int64))
    out["reverse"] = [reverse.rank, gathered.tolist()]
    reverse.close()
    try:  # rank 1 orders the members differently: every rank must learn of it, none may hang
        comm.split([0, 2, 1] if rank == 1 else [0, 1, 2])
        out["split_mismatch"] = "no error"
    except CollectiveMismatchError as exc:
        out["split_mismatch"] = str(exc)
    big = torch.ones(1 << 16)
    work = comm.all_reduce(big, async_op=True)
    assert work is not None
    work.wait()
    out["async"] = [work.is_completed(), big[0].item(), big[-1].item()]
    # 1 + (1 + 2^-7) + 2^-9 is 2.015625 rounded once; bf16 additions in any order give 2.0.
    half = torch.full((4,), (1.0, 1.0 + 2**-7, 2.0**-9)[rank % 3], dtype=torch.bfloat16)
    comm.all_reduce(half)
    out["bf16"] = half.float().tolist()
    if rank < 2:  # rank 0 sends 3 then 5 elements, rank 1 posts room for 4 each time
        out["mismatch"] = []
        for count in (3, 5):
            if rank == 0:
                comm.send(torch.arange(float(count)), 1)
                continue
            try:
                comm.recv(torch.empty(4), 0)
                out["mismatch"].append("no error")
            except CollectiveMismatchError as exc:
                out["mismatch"].append(str(exc))
    # all_to_all_single: rank 0 sends 3 rows to rank 1, which expects 2; every rank must name the pair
    ins = [1, 3, 1] if rank == 0 else [1, 1, 1]
    outs = [2, 1, 1] if rank == 1 else [1, 1, 1]
    try:
        comm.all_to_all_single(torch.zeros(sum(outs)), torch.ones(sum(ins)), outs, ins)
        out["split_sizes"] = "no error"
    except CollectiveMismatchError as exc:
        out["split_sizes"] = str(exc)
    errors = []
    for call in (
        lambda: comm.send(torch.ones(1), (rank + 1) % n, tag=-1),
        lambda: comm.all_reduce(torch.ones(2, dtype=torch.int64), op="avg"),
        lambda: comm.split([0, 0]),
    ):
        try:
            call()
            errors.append(None)
        except (TypeError, ValueError) as exc:
            errors.append(str(exc))
    out["errors"] = errors
    comm.barrier()
    report(out)
    meshwise.shutdown()


def bootstrap() -> None:
    """torch.distributed over gloo, its rendezvous completed over MPI (the test may export MASTER_ADDR)."""
    exported = [k for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if k in os.environ]
    world = meshwise.init("gloo", timeout=30)
    value = torch.tensor([float(world.rank + 1)])
    dist.all_reduce(value)
    report(
        {
            "rank": world.rank,
            "exported": exported,
            "launcher": world.launcher,
            "backend": dist.get_backend(),
            "world": [world.world_size, world.local_rank, world.local_world_size, world.node_rank],
            "sum": value.item(),
        }
    )
    meshwise.shutdown()


def early_exit() -> None:
    """Rank 1 leaves before a collective that rank 0 enters: rank 0 must fail by its timeout."""
    world = meshwise.init("mpi", timeout=3)
    if world.rank == 1:
        report({"rank": 1, "left": True})
        return
    start = time.monotonic()
    try:
        world.comm.all_reduce(torch.ones(4))
        message = "no error"
    except CommTimeoutError as exc:
        message = str(exc)
    report({"rank": 0, "error": message, "waited": time.monotonic() - start})
    raise SystemExit(3)


def crash() -> None:
    """Rank 1 raises (or dies) while rank 0 waits with a long timeout: the job must end at once."""
    world = meshwise.init("mpi", timeout=60)
    if world.rank == 1:
        if sys.argv[2] == "exit":
            os._exit(5)  # no traceback, no MPI_Finalize: a segfault or an OOM kill looks like this
        raise RuntimeError("rank 1 fails on purpose")
    try:
        world.comm.all_reduce(torch.ones(4))
    except CommError as exc:
        report({"rank": 0, "error": str(exc)})


def debug() -> None:
    """Debug mode on the mpi backend: rank 1 broadcasts while rank 0 all-reduces; both must say so."""
    world = meshwise.init("mpi", timeout=30, debug=True)
    start = time.monotonic()
    try:
        if world.rank == 1:
            world.comm.broadcast(torch.ones(3), root=0)
        else:
            world.comm.all_reduce(torch.ones(3))
        message = "no error"
    except CollectiveMismatchError as exc:
        message = str(exc)
    report({"rank": world.rank, "error": message, "waited": time.monotonic() - start})
    meshwise.shutdown()


if __name__ == "__main__":
    scenarios = {"matrix": matrix, "extras": extras, "bootstrap": bootstrap, "early_exit": early_exit}
    scenarios |= {"crash": crash, "debug": debug}
    scenarios[sys.argv[1]]()
