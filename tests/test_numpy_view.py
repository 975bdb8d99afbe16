"""comm.numpy_view: numpy sees a tensor's memory without making its storage non-resizable (ZeRO-3 frees
gathered parameters with ``untyped_storage().resize_(0)`` after they pass through shm or MPI)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshwise.comm.numpy_view import numpy_view
from meshwise.comm.shm.kernels import as_array, copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.uint8])
def test_the_view_shares_memory_and_leaves_the_storage_resizable(dtype: torch.dtype) -> None:
    tensor = torch.arange(12).to(dtype).reshape(3, 4)
    view = numpy_view(tensor)
    assert view.shape == (3, 4) and view.dtype == tensor.numpy().dtype.newbyteorder("=")
    view[1, 2] = 7
    assert tensor[1, 2].item() == 7
    fresh = torch.zeros(8, dtype=dtype)
    numpy_view(fresh)
    fresh.untyped_storage().resize_(0)  # raised "not resizable" after Tensor.numpy()
    assert fresh.untyped_storage().nbytes() == 0


def test_the_shm_kernels_copy_into_a_storage_zero3_later_frees() -> None:
    full = torch.zeros(16)
    copy(as_array(full), as_array(torch.arange(16, dtype=torch.float32)))
    assert torch.equal(full, torch.arange(16, dtype=torch.float32))
    full.untyped_storage().resize_(0)
    full.untyped_storage().resize_(16 * 4)  # gathered again next step


def test_empty_and_numpy_less_dtypes() -> None:
    assert numpy_view(torch.empty(0, 3)).shape == (0, 3)
    with pytest.raises(TypeError):
        numpy_view(torch.zeros(2, dtype=torch.bfloat16))
    assert isinstance(as_array(torch.zeros(2, dtype=torch.bfloat16)), torch.Tensor)
    assert isinstance(as_array(torch.zeros(2)), np.ndarray)
