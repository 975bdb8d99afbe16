"""The native (torch.distributed) Communicator on gloo: the seeds' worked examples, literally."""

import time

import torch

import meshwise
from conftest import joined
from meshwise.runtime.spawn import spawn


def _seed_tables():
    with joined("gloo", timeout=30) as world:
        comm, rank = world.comm, world.rank
        out = {}
        x = torch.tensor([float(rank + 1)])  # Exercise 0: GPU0..3 = [1],[2],[3],[4]
        reduced = x.clone()
        comm.reduce(reduced, root=0)
        out["reduce"] = reduced.tolist()
        summed = x.clone()
        comm.all_reduce(summed)
        out["all_reduce"] = summed.tolist()
        gathered = torch.empty(4)
        comm.all_gather(gathered, x)
        out["all_gather"] = gathered.tolist()
        row = torch.arange(rank + 1, rank + 5, dtype=torch.int64)  # HPC chapter: rank r holds [r+1 … r+4]
        shard = torch.empty(1, dtype=torch.int64)
        comm.reduce_scatter(shard, row)
        out["reduce_scatter"] = shard.tolist()
    return out


def test_seed_exercise_0_and_reduce_scatter_table():
    results = spawn(_seed_tables, 4, timeout=90)
    assert results[0]["reduce"] == [10.0]
    assert [r["reduce"] for r in results[1:]] == [[2.0], [3.0], [4.0]]  # non-roots unchanged
    assert all(r["all_reduce"] == [10.0] for r in results)
    assert all(r["all_gather"] == [1.0, 2.0, 3.0, 4.0] for r in results)
    assert [r["reduce_scatter"] for r in results] == [[10], [14], [18], [22]]


def _uneven_and_async():
    """Uneven slots, async handles, half precision and subgroups, checked against values computed by hand."""
    with joined("gloo", timeout=30) as world:
        comm, rank, n = world.comm, world.rank, world.world_size
        out = {}
        # all_gather with rank r contributing r+1 copies of r.
        slots = [torch.empty(r + 1, dtype=torch.int32) for r in range(n)]
        comm.all_gather(slots, torch.full((rank + 1,), rank, dtype=torch.int32))
        out["all_gather"] = [s.tolist() for s in slots]
        # reduce_scatter: slot i on every rank has i+1 elements equal to rank+1 → sum over ranks.
        piece = torch.empty(rank + 1, dtype=torch.int64)
        comm.reduce_scatter(piece, [torch.full((i + 1,), rank + 1, dtype=torch.int64) for i in range(n)])
        out["reduce_scatter"] = piece.tolist()
        # all_to_all: rank i sends j+1 copies of 10*i+j to rank j.
        recv = [torch.empty(rank + 1, dtype=torch.int64) for _ in range(n)]
        comm.all_to_all(recv, [torch.full((j + 1,), 10 * rank + j, dtype=torch.int64) for j in range(n)])
        out["all_to_all"] = [t.tolist() for t in recv]
        # scatter / gather with uneven sizes from/to root 1.
        part = torch.empty(rank + 2)
        comm.scatter(part, [torch.full((r + 2,), float(r)) for r in range(n)] if rank == 1 else None, root=1)
        out["scatter"] = part.tolist()
        gathered = [torch.empty(r + 2) for r in range(n)] if rank == 1 else None
        comm.gather(part, gathered, root=1)
        out["gather"] = [g.tolist() for g in gathered] if gathered else None
        # async all_reduce + bf16 accumulated in float32: 1 + 2^-8 * n is not representable step by step.
        half = torch.full((3,), 2.0**-9, dtype=torch.bfloat16)
        work = comm.all_reduce(half, async_op=True)
        work.wait()
        out["bf16"] = half.float().tolist()
        out["completed"] = work.is_completed()
        # a subgroup of the even ranks
        sub = comm.split([r for r in range(n) if r % 2 == 0])
        if sub is not None:
            x = torch.tensor([rank], dtype=torch.int64)
            sub.all_reduce(x)
            out["sub"] = (sub.rank, sub.world_size, x.item())
        else:
            out["sub"] = None
    return out


def test_uneven_async_half_and_subgroups():
    n = 3
    results = spawn(_uneven_and_async, n, timeout=90)
    for rank, res in enumerate(results):
        assert res["all_gather"] == [[r] * (r + 1) for r in range(n)]
        assert res["reduce_scatter"] == [sum(r + 1 for r in range(n))] * (rank + 1)
        assert res["all_to_all"] == [[10 * i + rank] * (rank + 1) for i in range(n)]
        assert res["scatter"] == [float(rank)] * (rank + 2)
        assert res["bf16"] == [n * 2.0**-9] * 3
        assert res["completed"] is True
    assert results[1]["gather"] == [[float(r)] * (r + 2) for r in range(n)]
    assert results[0]["gather"] is None
    assert results[0]["sub"] == (0, 2, 2) and results[2]["sub"] == (1, 2, 2) and results[1]["sub"] is None


def _silent_peer():
    world = meshwise.init("gloo", timeout=3)
    if world.rank == 1:  # alive but never joins: rank 0 must time out, not hang
        time.sleep(8)
        return "skipped the collective"
    try:
        world.comm.all_reduce(torch.ones(4))
    except meshwise.comm.CommTimeoutError as exc:
        return str(exc)
    return "no error"


def test_missing_peer_becomes_timeout_naming_rank_and_op():
    start = time.monotonic()
    message = spawn(_silent_peer, 2, timeout=60)[0]
    assert "rank 0" in message and "all_reduce" in message and "no progress within 3 s" in message
    assert time.monotonic() - start < 30


def _bad_input():
    with joined("gloo", timeout=10) as world:
        errors = []
        for call in (
            lambda: world.comm.all_reduce(torch.ones(2, dtype=torch.int32), op="avg"),
            lambda: world.comm.all_reduce(torch.ones(2, dtype=torch.bool)),
            lambda: world.comm.all_gather(torch.empty(3), torch.ones(1)),
            lambda: world.comm.broadcast(torch.ones(2), root=5),
            lambda: world.comm.all_reduce(torch.ones(4, 4).t()),
        ):
            try:
                call()
                errors.append(None)
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
    return errors


def test_bad_input_is_refused_before_any_communication():
    errors = spawn(_bad_input, 2, timeout=60)[0]
    assert "AVG is not defined for integer" in errors[0]
    assert "dtype torch.bool is not supported" in errors[1]
    assert "divisible by the world size 2" in errors[2]
    assert "root=5 is outside" in errors[3]
    assert "contiguous" in errors[4]


def _dying_peer():
    world = meshwise.init("gloo", timeout=20)
    if world.rank == 1:
        return "left"  # the process exits; its sockets close under rank 0's all_reduce
    time.sleep(0.5)
    try:
        world.comm.all_reduce(torch.ones(4))
    except meshwise.comm.CommError as exc:
        return type(exc).__name__
    return "no error"


def test_dead_peer_is_reported_before_the_timeout():
    start = time.monotonic()
    assert spawn(_dying_peer, 2, timeout=60)[0] == "PeerFailureError"
    assert time.monotonic() - start < 15  # well inside the 20 s communicator timeout
