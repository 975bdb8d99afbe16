"""Mesh: rank ↔ coordinates, groups and validation (no processes), and per-axis Communicators on 4 ranks."""

from __future__ import annotations

import itertools

import pytest
import torch

import meshwise
from meshwise.comm.mesh import AXES, Mesh, MeshShape
from meshwise.runtime.spawn import spawn


def _factorisations(n: int) -> list[tuple[int, int, int]]:
    return [(dp, tp, pp) for dp, tp, pp in itertools.product(range(1, n + 1), repeat=3) if dp * tp * pp == n]


@pytest.mark.parametrize(("dp", "tp", "pp"), _factorisations(8))
def test_every_factorisation_of_eight_ranks(dp: int, tp: int, pp: int) -> None:
    shape = MeshShape(dp=dp, tp=tp, pp=pp).validate(8)
    seen = set()
    for rank in range(8):
        c = shape.coordinates(rank)
        assert shape.rank_of(**c) == rank
        assert rank % tp == c["tp"]  # tp varies fastest (Megatron order)
        seen.add((c["pp"], c["dp"], c["tp"]))
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


def test_tp_groups_are_contiguous_ranks() -> None:
    shape = MeshShape(dp=2, tp=2, pp=2)
    assert shape.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    table = shape.layout_table([f"node{r // 4}" for r in range(8)])
    assert table.splitlines()[6].split() == ["5", "1", "0", "1", "node1"]


def test_validation_names_the_fix() -> None:
    with pytest.raises(ValueError, match=r"dp·tp·pp = 2·2·2 = 8 but 6 ranks were started"):
        MeshShape(dp=2, tp=2, pp=2).validate(6)
    with pytest.raises(ValueError, match="tp must be at least 1"):
        MeshShape(dp=1, tp=0, pp=1).validate(0)
    with pytest.raises(ValueError, match=r"cannot be split into tp·pp = 4·1 = 4"):
        MeshShape.infer(6, tp=4)
    assert MeshShape.infer(8, tp=2, pp=2) == MeshShape(dp=2, tp=2, pp=1 * 2)
    with pytest.raises(ValueError, match="unknown mesh axis"):
        MeshShape().groups("xp")


def _axis_sums() -> dict[str, list[float]]:
    world = meshwise.init(backend="gloo")
    try:
        mesh = Mesh(world.comm, MeshShape(dp=2, tp=2, pp=1))
        sums = {}
        for axis in AXES:
            value = torch.tensor([float(world.rank + 1)])
            mesh[axis].all_reduce(value)
            sums[axis] = value.tolist()
        mesh.close()
        return sums
    finally:
        meshwise.shutdown()


def test_all_reduce_over_tp_sums_only_inside_each_group() -> None:
    results = spawn(_axis_sums, 4, timeout=60)
    # ranks 0,1 form tp group 0 (1+2); ranks 2,3 tp group 1 (3+4); dp groups {0,2} and {1,3}; pp of one.
    assert [r["tp"] for r in results] == [[3.0], [3.0], [7.0], [7.0]]
    assert [r["dp"] for r in results] == [[4.0], [6.0], [4.0], [6.0]]
    assert [r["pp"] for r in results] == [[1.0], [2.0], [3.0], [4.0]]
