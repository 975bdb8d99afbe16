"""The communication patterns of Megatron-style tensor parallelism, as autograd functions.

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
``shard_sequence`` /        take / gather this rank's      the conjugate gather / take
``replicate_sequence``      slice of the sequence
==========================  =============================  ==========================================

A transformer layer enters its region twice (``copy_to_region`` before q/k/v and before the MLP's fc)
and leaves it twice (``reduce_from_region`` after ``out`` and ``proj``). Sequence parallelism splits each
all-reduce into the reduce-scatter and all-gather it is made of: the same bytes on the wire, while
LayerNorm, dropout and the residual adds run on ``1/t`` of the tokens. An all-gathered input would be
saved whole by the linears that read it, so :func:`gathered_linears` saves only the shard and gathers
again in backward (Korthikanti et al. 2022, §4.2.2), as the ``(sbh/t)(34 + 5as/h)`` formula assumes.

Activations are batch-first, so the sequence dimension defaults to 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from meshwise.comm.api import Communicator


def all_reduce_copy(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """The sum over ``comm`` in a new tensor (out of place: shm reads ``x`` directly, saving a copy)."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    comm.all_reduce(x.contiguous(), output=out)
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


def _same(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    return x.view_as(x)


def _summed(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    return all_reduce_copy(x, comm)


Way = Callable[[torch.Tensor, Communicator, int], torch.Tensor]


class _Conjugate(torch.autograd.Function):
    """``there`` forward and ``back`` backward: a collective and its conjugate (the module's table)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int, there: Way, back: Way) -> Any:
        ctx.comm, ctx.dim, ctx.back = comm, dim, back
        return there(x, comm, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        return ctx.back(grad, ctx.comm, ctx.dim), None, None, None, None


def _conjugate(x: torch.Tensor, comm: Communicator, dim: int, there: Way, back: Way) -> torch.Tensor:
    """``x`` through ``there``, its gradient through ``back``; with one rank the identity, sending nothing."""
    return x if comm.world_size == 1 else _Conjugate.apply(x, comm, dim, there, back)


class _GatheredLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int, *params: torch.Tensor | None):
        full = gather_along(x, comm, dim)
        weights, biases = params[0::2], params[1::2]
        ctx.save_for_backward(x, *weights)
        ctx.comm, ctx.dim, ctx.has_bias = comm, dim, [b is not None for b in biases]
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases, strict=True))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        full = gather_along(x, ctx.comm, ctx.dim)  # the full input was not kept: gather it again
        # under autocast the outputs (so their gradients) may be bf16 while x and the weights are not
        grads = tuple(grad.to(w.dtype) for grad, w in zip(grads, weights, strict=True))
        grad_full = sum(grad @ w for grad, w in zip(grads, weights, strict=True)).to(x.dtype)
        result: list[torch.Tensor | None] = [_reduce_scatter(grad_full, ctx.comm, ctx.dim), None, None]
        rows = full.reshape(-1, full.shape[-1])
        for grad, w, has_bias in zip(grads, weights, ctx.has_bias, strict=True):
            grad = grad.reshape(-1, grad.shape[-1])
            result += [grad.t() @ rows.to(w.dtype), grad.sum(0) if has_bias else None]
        return tuple(result)


def gathered_linears(
    x: torch.Tensor,
    comm: Communicator,
    layers: list[tuple[torch.Tensor, torch.Tensor | None]],
    dim: int = 1,
) -> tuple[torch.Tensor, ...]:
    """``F.linear(gather_from_sequence(x), w, b)`` for every ``(w, b)`` in ``layers``, saving only the shard:
    one all-gather forward; backward one all-gather (the re-gather) and one reduce-scatter of the summed
    input gradients, however many layers share the input (attention's q, k and v are three)."""
    if comm.world_size == 1:
        return tuple(F.linear(x, w, b) for w, b in layers)
    return _GatheredLinears.apply(x, comm, dim, *(t for layer in layers for t in layer))


# The module's table, each op a collective and its conjugate; with one rank each is the identity.
def copy_to_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return _conjugate(x, comm, -1, _same, _summed)


def reduce_from_region(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return _conjugate(x, comm, -1, _summed, _same)


def gather_from_sequence(x: torch.Tensor, comm: Communicator, dim: int = 1) -> torch.Tensor:
    return _conjugate(x, comm, dim, gather_along, _reduce_scatter)


def scatter_to_sequence(x: torch.Tensor, comm: Communicator, dim: int = 1) -> torch.Tensor:
    return _conjugate(x, comm, dim, _reduce_scatter, gather_along)


def split_last(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return _conjugate(x, comm, -1, _take, gather_along)


def gather_last(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return _conjugate(x, comm, -1, gather_along, _take)


def replicate_sequence(x: torch.Tensor, comm: Communicator, dim: int = 1) -> torch.Tensor:
    """The whole sequence for a computation every rank then runs identically (not a parallel region:
    its input gradient is the same on every rank, so each keeps its slice)."""
    return _conjugate(x, comm, dim, gather_along, _take)


def shard_sequence(x: torch.Tensor, comm: Communicator, dim: int = 1) -> torch.Tensor:
    return _conjugate(x, comm, dim, _take, gather_along)
