"""The shm data path's copy and reduce kernels (numpy where numpy has the dtype, torch for bfloat16),
against torch's own arithmetic: exact for integers, and for floats the same bits as one float32 (or
float64) accumulation in rank order rounded once, which is the contract every backend keeps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshwise.comm.api import ReduceOp
from meshwise.comm.shm import kernels
from meshwise.comm.shm.kernels import as_array, copy, reduce_into


def _reference(sources: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """op over ``sources`` in order, accumulated in float32 for half types, rounded once."""
    acc_dtype = torch.float32 if sources[0].dtype in (torch.float16, torch.bfloat16) else sources[0].dtype
    acc = sources[0].to(acc_dtype).clone()
    combine = {ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum, ReduceOp.PROD: torch.mul}
    for s in sources[1:]:
        acc = combine.get(op, torch.add)(acc, s.to(acc_dtype))
    if op is ReduceOp.AVG:
        acc = acc / len(sources)
    return acc.to(sources[0].dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_blocked_reduction_matches_one_accumulation(dtype, ranks, monkeypatch):
    monkeypatch.setattr(kernels, "BLOCK_ELEMENTS", 96)  # several blocks and a ragged last one
    gen = torch.Generator().manual_seed(ranks)
    count = 1000
    if dtype.is_floating_point:
        sources = [(torch.randn(count, generator=gen) * 3).to(dtype) for _ in range(ranks)]
    else:
        sources = [torch.randint(-1000, 1000, (count,), generator=gen, dtype=dtype) for _ in range(ranks)]
    ops = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PROD]
    ops += [ReduceOp.AVG] if dtype.is_floating_point else []
    for op in ops:
        out = torch.full((count,), 7, dtype=dtype)
        reduce_into(as_array(out), [as_array(s) for s in sources], op, ranks)
        want = _reference(sources, op)
        assert torch.equal(out, want), op


def test_half_sums_are_rounded_once_not_per_step():
    # 2048 + 1 + 1 in float16: per-step rounding loses both ones (2048 + 1 rounds to 2048); float32 keeps them
    sources = [torch.tensor([2048.0], dtype=torch.float16), torch.ones(1, dtype=torch.float16),
               torch.ones(1, dtype=torch.float16)]  # fmt: skip
    out = torch.empty(1, dtype=torch.float16)
    reduce_into(as_array(out), [as_array(s) for s in sources], ReduceOp.SUM, 3)
    assert out.item() == 2050.0


def test_the_output_may_be_the_first_source_and_arrays_share_the_tensors_memory():
    first, second = torch.arange(10, dtype=torch.int64), torch.full((10,), 5, dtype=torch.int64)
    reduce_into(as_array(first), [as_array(first), as_array(second)], ReduceOp.SUM, 2)
    assert first.tolist() == [k + 5 for k in range(10)]
    target = torch.zeros(4, dtype=torch.bfloat16)
    copy(as_array(target), as_array(torch.ones(4, dtype=torch.bfloat16)))  # torch path: numpy has no bf16
    assert target.tolist() == [1.0] * 4 and isinstance(as_array(first), np.ndarray)
