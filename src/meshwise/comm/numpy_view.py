"""A tensor's memory as a numpy array, without ``Tensor.numpy()``.

The shm and MPI backends hand numpy views of the caller's tensors to memcpy, ufuncs and mpi4py (numpy
calls cost far less than torch calls on small messages). ``Tensor.numpy()`` would do, but it marks the
tensor's storage non-resizable for good, and ZeRO-3 frees its gathered parameters by resizing their
storage to zero between uses (``untyped_storage().resize_(0)``): one collective through ``.numpy()``
and the next free fails. :func:`numpy_view` builds the same view through numpy's array interface
instead, which leaves the storage as it was; the array keeps the tensor alive through its ``base``.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch


@cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """numpy's dtype for ``dtype`` (TypeError where numpy has none, e.g. bfloat16), asked of an empty
    tensor so no caller's storage is touched."""
    return torch.empty(0, dtype=dtype).numpy().dtype


class _TensorMemory:
    """Presents a contiguous CPU tensor through numpy's array interface and keeps it alive."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, tensor: torch.Tensor, dtype: np.dtype) -> None:
        self.tensor = tensor
        self.__array_interface__ = {
            "data": (tensor.data_ptr(), False),
            "shape": tuple(tensor.shape),
            "typestr": dtype.str,
            "version": 3,
        }


def numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """``tensor``'s memory (CPU, contiguous) as a numpy array of the same shape and dtype, no copy.
    Raises TypeError for dtypes numpy lacks, as ``Tensor.numpy()`` does."""
    dtype = _numpy_dtype(tensor.dtype)
    if not tensor.is_contiguous():
        raise ValueError("numpy_view needs a contiguous tensor")
    if tensor.numel() == 0:
        return np.empty(tuple(tensor.shape), dtype=dtype)
    return np.asarray(_TensorMemory(tensor.detach(), dtype))
