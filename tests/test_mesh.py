"""Mesh: rank ↔ coordinates, groups and validation (no processes), per-axis Communicators on 4 ranks, the
torch DeviceMesh bridge, and ``init(mesh=…)`` refusing a second, different shape."""

from __future__ import annotations

import itertools
import math
import pickle

import pytest
import torch

import meshwise
from meshwise.comm.mesh import AXES, BATCH_AXES, GROUPINGS, MeshShape
from meshwise.runtime.spawn import spawn


def _factorisations(n: int, axes: int) -> list[tuple[int, ...]]:
    return [sizes for sizes in itertools.product(range(1, n + 1), repeat=axes) if math.prod(sizes) == n]


@pytest.mark.parametrize("sizes", _factorisations(8, len(AXES)), ids=str)
def test_every_factorisation_of_eight_ranks_on_every_axis(sizes: tuple[int, ...]) -> None:
    shape = MeshShape(**dict(zip(AXES, sizes, strict=True))).validate(8)
    seen = set()
    for rank in range(8):
        c = shape.coordinates(rank)
        assert shape.rank_of(**c) == rank
        assert rank % shape.tp == c["tp"]  # tp varies fastest (Megatron order)
        seen.add(tuple(c.values()))
    assert len(seen) == 8
    for axis in AXES:
        groups = shape.groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(8))  # a partition of the ranks
        assert all(len(g) == getattr(shape, axis) for g in groups)
        for group in groups:  # members differ only along `axis`, listed in coordinate order
            coords = [shape.coordinates(r) for r in group]
            assert [c[axis] for c in coords] == list(range(len(group)))
            for other in AXES:
                if other != axis:
                    assert len({c[other] for c in coords}) == 1
    batch = shape.groups(*BATCH_AXES)
    assert all(len(g) == shape.batch_size for g in batch)
    for group in batch:  # a rank's batch slice is its place in its batch group, the same in every group
        assert [shape.batch_index(r) for r in group] == list(range(shape.batch_size))


def test_tp_groups_are_contiguous_ranks() -> None:
    shape = MeshShape(dp=2, tp=2, pp=2)
    assert shape.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    table = shape.layout_table([f"node{r // 4}" for r in range(8)])
    assert table.splitlines()[6].split() == ["5", "1", "0", "1", "node1"]


def test_two_axis_groups_and_the_order_of_the_axes() -> None:
    shape = MeshShape(pp=2, dp=2, ep=2, cp=2, tp=2)
    assert shape.coordinates(1) == {"pp": 0, "dp": 0, "ep": 0, "cp": 0, "tp": 1}
    assert shape.coordinates(2) == {"pp": 0, "dp": 0, "ep": 0, "cp": 1, "tp": 0}
    assert shape.coordinates(16) == {"pp": 1, "dp": 0, "ep": 0, "cp": 0, "tp": 0}
    assert shape.groups("dp", "ep")[0] == [0, 4, 8, 12]  # dp slower than ep: row-major over (dp, ep)
    assert shape.batch_size == 4 and shape.batch_index(12) == 3
    assert MeshShape(dp=2, tp=2).describe() == "dp=2 tp=2 pp=1"
    assert MeshShape(cp=2, dp=2).describe() == "dp=2 tp=1 pp=1 cp=2"
    assert MeshShape(dp=2) == MeshShape(dp=2, tp=1) and hash(MeshShape(dp=2)) == hash(MeshShape(dp=2, pp=1))
    assert pickle.loads(pickle.dumps(shape)) == shape
    with pytest.raises(AttributeError, match="immutable"):
        shape.tp = 4  # type: ignore[misc]


def test_validation_names_the_fix() -> None:
    with pytest.raises(ValueError, match=r"pp·dp·tp = 2·2·2 = 8 but 6 ranks were started"):
        MeshShape(dp=2, tp=2, pp=2).validate(6)
    with pytest.raises(ValueError, match="tp must be at least 1"):
        MeshShape(dp=1, tp=0, pp=1).validate(0)
    with pytest.raises(ValueError, match=r"6 ranks cannot be split into pp·tp = 2·2 = 4 groups"):
        MeshShape.infer(6, tp=2, pp=2)
    with pytest.raises(ValueError, match=r"6 ranks do not split into groups of --tp 4: use a divisor of 6"):
        MeshShape.infer(6, tp=4)
    with pytest.raises(ValueError, match=r"--cp 4 is larger than the 2 ranks started"):
        MeshShape.infer(2, cp=4)
    assert MeshShape.infer(8, tp=2, pp=2) == MeshShape(dp=2, tp=2, pp=1 * 2)
    assert MeshShape.infer(8, cp=2, ep=2) == MeshShape(dp=2, cp=2, ep=2)
    with pytest.raises(ValueError, match="unknown mesh axis"):
        MeshShape().groups("xp")
    with pytest.raises(ValueError, match="unknown mesh axis 'xp'"):
        MeshShape(xp=2)


def _axis_sums() -> dict:
    world = meshwise.init(backend="gloo", mesh=MeshShape(dp=2, tp=2))
    try:
        assert meshwise.init(backend="gloo", mesh=MeshShape(dp=2, tp=2)) is world  # same shape: same World
        try:
            meshwise.init(backend="gloo", mesh=MeshShape(tp=4))
            refused = ""
        except ValueError as exc:
            refused = str(exc)
        mesh = world.mesh
        sums: dict = {"refused": refused, "batch_index": mesh.batch_index}
        for axis in (*AXES, "batch"):
            value = torch.tensor([float(world.rank + 1)])
            mesh[axis].all_reduce(value)
            sums[axis] = value.tolist()
        device_mesh = mesh.device_mesh()
        sums["device_mesh"] = (device_mesh.mesh_dim_names, device_mesh["tp"].mesh.tolist())
        return sums
    finally:
        meshwise.shutdown()


def test_axis_communicators_sum_only_inside_each_group_and_torch_sees_the_same_mesh() -> None:
    results = spawn(_axis_sums, 4, timeout=90)
    # ranks 0,1 form tp group 0 (1+2); ranks 2,3 tp group 1 (3+4); dp groups {0,2} and {1,3}; others of one.
    assert [r["tp"] for r in results] == [[3.0], [3.0], [7.0], [7.0]]
    assert [r["dp"] for r in results] == [[4.0], [6.0], [4.0], [6.0]]
    assert [r["batch"] for r in results] == [[4.0], [6.0], [4.0], [6.0]]  # ep of one: batch = dp
    assert [r["batch_index"] for r in results] == [0, 0, 1, 1]
    for axis in ("pp", "ep", "cp"):
        assert [r[axis] for r in results] == [[1.0], [2.0], [3.0], [4.0]]
    assert [r["device_mesh"] for r in results] == [
        (AXES, [0, 1]),
        (AXES, [0, 1]),
        (AXES, [2, 3]),
        (AXES, [2, 3]),
    ]
    assert all("already joined with MeshShape(dp=2, tp=2)" in r["refused"] for r in results)


def _grouping_sums() -> dict:
    world = meshwise.init(backend="gloo", mesh=MeshShape(ep=2, cp=2))
    try:
        sums: dict = {}
        for name in GROUPINGS:
            value = torch.tensor([float(world.rank + 1)])
            world.mesh[name].all_reduce(value)
            sums[name] = value.item()
        return sums
    finally:
        meshwise.shutdown()


def test_groupings_over_several_axes_reduce_over_the_right_ranks() -> None:
    results = spawn(_grouping_sums, 4, timeout=90)
    # ep × cp = 2 × 2 (cp fastest): ep groups {0,2} {1,3}, cp groups {0,1} {2,3}
    assert [r["batch"] for r in results] == [4.0, 6.0, 4.0, 6.0]  # the ep ranks read different data
    assert [r["replicas"] for r in results] == [10.0] * 4  # every rank holds the same dense weights
    assert [r["expert_replicas"] for r in results] == [3.0, 3.0, 7.0, 7.0]  # same experts: the cp pair
