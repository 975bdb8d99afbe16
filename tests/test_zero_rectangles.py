"""The boxes that cover a flat element range: exact cover for random shapes and shardings, few boxes."""

from __future__ import annotations

import math
import random

import pytest
import torch

from meshwise.parallel.zero.layout import FlatLayout, boxes


def _covered(shape: tuple[int, ...], start: int, end: int) -> torch.Tensor:
    """How many boxes cover each element, computed by indexing the real tensor (not by the same math)."""
    count = torch.zeros(shape, dtype=torch.int64)
    flat_index = torch.arange(math.prod(shape)).view(shape)
    for box in boxes(shape, start, end):
        region = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))
        # the box's elements are exactly the contiguous flat run it claims
        expected = torch.arange(box.flat_start, box.flat_start + box.numel)
        assert torch.equal(flat_index[region].reshape(-1), expected), (shape, start, end, box)
        count[region] += 1
    return count


def test_a_two_dimensional_range_is_a_partial_row_whole_rows_and_a_partial_row() -> None:
    found = [(b.offsets, b.sizes) for b in boxes((4, 5), 3, 17)]
    assert found == [((0, 3), (1, 2)), ((1, 0), (2, 5)), ((3, 0), (1, 2))]
    assert [(b.offsets, b.sizes) for b in boxes((4, 5), 5, 15)] == [((1, 0), (2, 5))]
    assert [(b.offsets, b.sizes) for b in boxes((4, 5), 6, 8)] == [((1, 1), (1, 2))]
    assert [(b.offsets, b.sizes) for b in boxes((7,), 2, 6)] == [((2,), (4,))]
    assert boxes((3, 3), 4, 4) == []


def test_random_shapes_sharded_over_one_to_five_ranks_are_covered_exactly_once() -> None:
    rng = random.Random(16)
    for _ in range(200):
        dims = [rng.randint(1, 4) for _ in range(rng.randint(1, 4))]
        shapes = [tuple(rng.randint(1, 6) for _ in range(d)) for d in dims]
        for world in range(1, 6):
            layout = FlatLayout(tuple(math.prod(s) for s in shapes), world)
            counts = [torch.zeros(s, dtype=torch.int64) for s in shapes]
            for rank in range(world):
                for piece in layout.pieces(rank):
                    shape = shapes[piece.param]
                    got = boxes(shape, piece.param_start, piece.param_start + piece.numel)
                    assert len(got) <= 2 * len(shape) - 1, (shape, piece, got)
                    assert sum(b.numel for b in got) == piece.numel
                    counts[piece.param] += _covered(shape, piece.param_start, piece.param_start + piece.numel)
            assert all(bool((c == 1).all()) for c in counts), (shapes, world)


def test_a_range_outside_the_tensor_is_refused() -> None:
    with pytest.raises(ValueError, match=r"element range \[2, 9\) is outside shape \(2, 4\)"):
        boxes((2, 4), 2, 9)
