"""The shm data path's two primitives, copy and element-wise combine, on the fastest routines available.

Every byte a shm collective moves passes through :func:`copy` or :func:`reduce_into`, so their speed
is the transport's. numpy's ``copyto`` is glibc's ``memcpy`` and its ufuncs (``np.add(a, b, out=c)``)
are vectorised loops: on the 2-core host of benchmarks/results they copied 256 MiB at 12.6–16.6 GB/s on
one core against 8.8 GB/s for torch's single-threaded ``copy_``, and each call costs ~0.5 µs of Python
where a torch call costs 1–2 µs — which at 4 KiB is most of a collective. So the collectives work on
*arrays*: numpy views of the tensors and of the shared regions for every dtype numpy has, torch tensors
for bfloat16, which numpy lacks (the same code runs on both; only these functions tell them apart).

Reductions of more than two sources, and of half types (accumulated in float32, rounded once), run in
cache-sized blocks: the running result stays in cache while each source streams past it once, instead
of the whole result travelling to memory and back for every source.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from meshwise.comm.api import ReduceOp, accumulator_dtype
from meshwise.comm.numpy_view import numpy_view

#: numpy arrays for the dtypes numpy has, torch tensors (bfloat16) for the others
Array = np.ndarray | torch.Tensor

#: elements per block of a blocked reduction: 64 Ki float32 = 256 KiB, inside a core's L2 cache
BLOCK_ELEMENTS = 1 << 16

_NUMPY = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.int32: np.int32,
    torch.int64: np.int64,
}

_NP_COMBINE: dict[ReduceOp, Callable[..., np.ndarray]] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.MAX: np.maximum,
    ReduceOp.MIN: np.minimum,
    ReduceOp.PROD: np.multiply,
}
_TORCH_COMBINE: dict[ReduceOp, Callable[..., torch.Tensor]] = {
    ReduceOp.SUM: torch.add,
    ReduceOp.AVG: torch.add,
    ReduceOp.MAX: torch.maximum,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.PROD: torch.mul,
}


def numpy_dtype(dtype: torch.dtype) -> type | None:
    """numpy's type for ``dtype``, or None where numpy has none (bfloat16): then torch does the work."""
    return _NUMPY.get(dtype)


def as_array(tensor: torch.Tensor) -> Array:
    """``tensor``'s memory as a flat array (no copy): numpy where it can be, else the tensor itself."""
    flat = tensor.detach().view(-1)
    return numpy_view(flat) if tensor.dtype in _NUMPY else flat


def size(array: Array) -> int:
    return array.size if isinstance(array, np.ndarray) else array.numel()


def copy(dst: Array, src: Array) -> None:
    """``dst[:] = src`` (same length and dtype)."""
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
    else:
        dst.copy_(src)


def same_memory(a: Array, b: Array) -> bool:
    """Whether two arrays start at the same address (an in-place argument)."""
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    return a.data_ptr() == b.data_ptr()


def reduce_into(out: Array, sources: Sequence[Array], op: ReduceOp, world_size: int) -> None:
    """``out`` = op over ``sources`` in rank order — the same order on every rank, so every rank gets
    the same bits; half types accumulate in float32 and are rounded once. AVG divides once, at the end.
    ``out`` may be one of the sources only if it is the first."""
    numpy = isinstance(out, np.ndarray)
    half = (out.dtype == np.float16) if numpy else accumulator_dtype(out.dtype) != out.dtype
    if len(sources) <= 2 and not half:
        _combine_all(out, sources, op, world_size, numpy)
        return
    count = size(out)
    scratch = _scratch(out, min(count, BLOCK_ELEMENTS), numpy) if half else None
    for start in range(0, count, BLOCK_ELEMENTS):
        stop = min(start + BLOCK_ELEMENTS, count)
        block = [s[start:stop] for s in sources]
        if scratch is None:
            _combine_all(out[start:stop], block, op, world_size, numpy)
            continue
        acc = scratch[: stop - start]
        _combine_all(acc, block, op, world_size, numpy)
        copy(out[start:stop], acc)


def _scratch(out: Array, count: int, numpy: bool) -> Array:
    if numpy:
        return np.empty(count, dtype=np.float32)
    return torch.empty(count, dtype=torch.float32)


def _combine_all(out: Array, sources: Sequence[Array], op: ReduceOp, world_size: int, numpy: bool) -> None:
    combine = _NP_COMBINE[op] if numpy else _TORCH_COMBINE[op]
    first = sources[0]
    if len(sources) == 1 or out.dtype != first.dtype:
        if numpy:
            np.copyto(out, first)  # float16 -> float32: exact
        else:
            out.copy_(first)
        rest = sources[1:]
    else:
        combine(first, sources[1], out=out)
        rest = sources[2:]
    for src in rest:
        combine(out, src, out=out)
    if op is ReduceOp.AVG:
        if numpy:
            np.divide(out, world_size, out=out)
        else:
            out.div_(world_size)
