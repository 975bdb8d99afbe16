"""The native (torch.distributed) Communicator on gloo: the seeds' worked examples, literally."""

import torch

import meshwise
from meshwise.runtime.spawn import spawn


def _seed_tables():
    world = meshwise.init("gloo", timeout=30)
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
    meshwise.shutdown()
    return out


def test_seed_exercise_0_and_reduce_scatter_table():
    results = spawn(_seed_tables, 4, timeout=90)
    assert results[0]["reduce"] == [10.0]
    assert [r["reduce"] for r in results[1:]] == [[2.0], [3.0], [4.0]]  # non-roots unchanged
    assert all(r["all_reduce"] == [10.0] for r in results)
    assert all(r["all_gather"] == [1.0, 2.0, 3.0, 4.0] for r in results)
    assert [r["reduce_scatter"] for r in results] == [[10], [14], [18], [22]]
