"""Placements: each element of the plain model counted once in the global gradient norm, on any layout
(plain data: the ranks' contributions are computed in one process and summed as the all-reduce would)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from meshwise.comm.mesh import MeshShape
from meshwise.parallel.placement import Placement, clip_gradients_, place
from meshwise.parallel.tensor_parallel.layers import SHARD_DIM


class _Contribution:
    """Stands in for the job communicator: keeps what this rank would put into the all-reduce."""

    def __init__(self) -> None:
        self.sent = 0.0

    def all_reduce(self, tensor: torch.Tensor, op: object = None) -> None:
        self.sent = tensor.item()


def _norm_on(shape: MeshShape, pieces_of: dict[int, list[tuple[torch.Tensor, Placement]]]) -> float:
    total = 0.0
    for rank in range(shape.size):
        job = _Contribution()
        clip_gradients_(pieces_of[rank], 0.0, shape.coordinates(rank), job)  # type: ignore[arg-type]
        total += job.sent
    return math.sqrt(total)


def test_every_element_counts_once_on_a_tp_pp_dp_mesh_with_a_tied_copy() -> None:
    torch.manual_seed(0)
    weight, bias, embedding, norm = torch.randn(4, 6), torch.randn(4), torch.randn(5, 6), torch.randn(6)
    expected = math.sqrt(sum(t.double().square().sum().item() for t in (weight, bias, embedding, norm)))
    shape = MeshShape(pp=2, dp=2, tp=2)
    column = Placement("w", divided=frozenset({"pp", "tp"}), tp_dim=0)
    replicated = Placement("b", divided=frozenset({"pp"}))
    pieces: dict[int, list[tuple[torch.Tensor, Placement]]] = {}
    for rank in range(shape.size):
        c = shape.coordinates(rank)
        if c["pp"] == 0:  # stage 0: the layer (tp-sharded weight, replicated bias) and the embedding
            pieces[rank] = [
                (weight.chunk(2)[c["tp"]], column),
                (bias, replicated),
                (embedding, Placement("wte", divided=frozenset({"pp"}))),
            ]
        else:  # stage 1: the final norm and its copy of the tied embedding (counted on stage 0 only)
            pieces[rank] = [
                (norm, Placement("ln", divided=frozenset({"pp"}))),
                (embedding, Placement("head", divided=frozenset({"pp"}), tied_to="wte")),
            ]
    assert _norm_on(shape, pieces) == pytest.approx(expected, rel=1e-12)


def test_place_reads_the_tensor_parallel_mark_and_clipping_follows_torch() -> None:
    layer = nn.Linear(3, 4)
    setattr(layer.weight, SHARD_DIM, 0)
    placements = place(layer.named_parameters(), divided={"dp"}, tied={"bias": "other"})
    assert placements["weight"] == Placement("weight", frozenset({"dp", "tp"}), tp_dim=0)
    origin = MeshShape().coordinates(0)
    assert placements["bias"].tied_to == "other" and not placements["bias"].counted_at(origin)
    with pytest.raises(ValueError, match="unknown mesh axes"):
        Placement("x", divided=frozenset({"xp"}))
    with pytest.raises(ValueError, match="a tp_dim needs tp"):
        Placement("x", tp_dim=0)
    reference = nn.Linear(3, 4)
    ours = nn.Linear(3, 4)
    for p, q in zip(reference.parameters(), ours.parameters(), strict=True):
        p.grad = torch.full_like(p, 2.0)
        q.grad = torch.full_like(q, 2.0)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    pairs = [(p.grad, Placement(n)) for n, p in ours.named_parameters()]
    norm = clip_gradients_(pairs, 1.0, MeshShape().coordinates(0), _Contribution())  # type: ignore[arg-type]
    assert norm == pytest.approx(expected.item(), rel=1e-6)
    for p, q in zip(reference.parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
