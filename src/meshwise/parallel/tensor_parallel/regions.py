"""The four communication patterns of Megatron-style tensor parallelism, as autograd functions.

Each op is a pair of collectives, one in forward and its *conjugate* in backward, because the gradient
of a collective is its transpose: the gradient of "every rank uses the same x" is "sum the ranks'
gradients", and vice versa. Over a tensor-parallel group of ``t`` ranks:

==========================  =============================  ==========================================
op                          forward                        backward
==========================  =============================  ==========================================
``copy_to_region``          identity (x is replicated)     all-reduce (sum the partial gradients)
``reduce_from_region``      all-reduce (sum partials)      identity (the gradient is replicated)
``gather_from_sequence``    all-gather sequence shards     reduce-scatter to sequence shards
``scatter_to_sequence``     reduce-scatter to sequence     all-gather sequence shards
``split_last`` / ``gather_last``  take / gather this       the conjugate gather / take
                            rank's slice of the last dim
==========================  =============================  ==========================================

Without sequence parallelism a transformer layer enters its parallel region twice
(``copy_to_region`` before attention's q/k/v and before the MLP's fc) and leaves it twice
(``reduce_from_region`` after ``out`` and ``proj``): two all-reduces forward, two backward. With
sequence parallelism the residual stream is split along the sequence between the regions, and each
all-reduce becomes the all-gather / reduce-scatter pair it is made of (a ring all-reduce *is* a
reduce-scatter then an all-gather), so the bytes on the wire stay the same while LayerNorm, dropout and
the residual adds run on ``1/t`` of the tokens.

Activations are batch-first ``(batch, seq, hidden)`` as in our GPT, so the sequence dimension is 1;
the ops take ``dim`` so they work for any layout. With ``t = 1`` every op is the identity and sends
nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from meshwise.comm.api import Communicator


def all_reduce_copy(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    out = x.contiguous().clone()
    comm.all_reduce(out)
    return out


def gather_along(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    x = x.contiguous()
    slots = torch.empty((comm.world_size, *x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather(slots, x)
    if dim % x.dim() == 0:
        return slots.reshape(comm.world_size * x.shape[0], *x.shape[1:])
    return torch.cat(slots.unbind(0), dim=dim)


def _check_divisible(x: torch.Tensor, comm: Communicator, dim: int, op: str) -> None:
    if x.shape[dim] % comm.world_size:
        raise ValueError(
            f"[rank {comm.rank} · {op}] cannot split {x.shape[dim]} positions (dimension {dim} of shape "
            f"{tuple(x.shape)}) into {comm.world_size} tensor-parallel shards: under sequence parallelism "
            f"use a sequence length that is a multiple of --tp {comm.world_size}"
        )


def _reduce_scatter(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    """Sum over ranks, keeping this rank's ``1/t`` slice of ``dim``."""
    _check_divisible(x, comm, dim, "reduce_scatter")
    slots = [chunk.contiguous() for chunk in x.chunk(comm.world_size, dim=dim)]
    out = torch.empty_like(slots[comm.rank])
    comm.reduce_scatter(out, slots)
    return out


def _take(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    _check_divisible(x, comm, dim, "split")
    return x.chunk(comm.world_size, dim=dim)[comm.rank].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce_copy(grad, ctx.comm), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        return all_reduce_copy(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return gather_along(x, comm, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _reduce_scatter(grad, ctx.comm, ctx.dim), None, None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _reduce_scatter(x, comm, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return gather_along(grad, ctx.comm, ctx.dim), None, None


class _SplitLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return _take(x, comm, -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gather_along(grad, ctx.comm, -1), None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return gather_along(x, comm, -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _take(grad, ctx.comm, -1), None


def copy_to_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Enter a parallel region with a replicated input: identity forward, all-reduce backward."""
    return x if comm.world_size == 1 else _CopyToRegion.apply(x, comm)


def reduce_from_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Leave a parallel region by summing partial results: all-reduce forward, identity backward."""
    return x if comm.world_size == 1 else _ReduceFromRegion.apply(x, comm)


def gather_from_sequence(x: torch.Tensor, comm: Communicator, dim: int = 1) -> torch.Tensor:
    """Enter a parallel region from sequence shards: all-gather forward, reduce-scatter backward."""
    return x if comm.world_size == 1 else _GatherFromSequence.apply(x, comm, dim)


def scatter_to_sequence(x: torch.Tensor, comm: Communicator, dim: int = 1) -> torch.Tensor:
    """Leave a parallel region into sequence shards: reduce-scatter forward, all-gather backward."""
    return x if comm.world_size == 1 else _ScatterToSequence.apply(x, comm, dim)


def split_last(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """This rank's slice of the last dimension of a replicated tensor (gradient: all-gather)."""
    return x if comm.world_size == 1 else _SplitLast.apply(x, comm)


def gather_last(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Concatenate the ranks' slices of the last dimension (gradient: each rank keeps its slice)."""
    return x if comm.world_size == 1 else _GatherLast.apply(x, comm)
