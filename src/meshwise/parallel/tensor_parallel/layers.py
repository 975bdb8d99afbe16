"""Column- and row-parallel linear layers (``Y = X·Wᵀ + b``, ``W`` of shape (out, in)).

- **column parallel** keeps ``out/t`` rows of ``W`` (and of the bias) and computes those output columns
  from the full input; entering the region (``copy_to_region``, or under sequence parallelism the fused
  ``gathered_linears``) sums the input's partial gradients backward.
- **row parallel** keeps ``in/t`` columns, multiplies a column layer's output shard and sums the partial
  ``Y`` over the ranks (all-reduce, or reduce-scatter into sequence shards); the bias, replicated, is added
  once after the sum.

Column then row (attention's q/k/v then ``out``, the MLP's fc then proj) needs one collective each way per
pair, since the nonlinearity between them is element-wise on the shards. Sharded parameters carry
``tp_shard_dim``; every other parameter of a tensor-parallel model is replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshwise.comm.api import Communicator
from meshwise.parallel.tensor_parallel.regions import (
    all_reduce_copy,
    copy_to_region,
    gather_last,
    gathered_linears,
    reduce_from_region,
    scatter_to_sequence,
    split_last,
)

#: The attribute that marks a parameter as a shard and says which dimension it was cut along.
SHARD_DIM = "tp_shard_dim"
_SUMMED = "tp_gradient_summed"


def shard_dim(param: torch.Tensor) -> int | None:
    """The dimension ``param`` is sharded along across the tensor-parallel group, or None if replicated."""
    return getattr(param, SHARD_DIM, None)


def shard_parameter(full: torch.Tensor, comm: Communicator, dim: int) -> nn.Parameter:
    """This rank's ``1/t`` slice of ``full`` along ``dim`` as a new marked Parameter."""
    if full.shape[dim] % comm.world_size:
        raise ValueError(
            f"cannot shard a tensor of shape {tuple(full.shape)} along dimension {dim} over "
            f"{comm.world_size} tensor-parallel ranks: the size must be a multiple of --tp"
        )
    piece = full.detach().chunk(comm.world_size, dim=dim)[comm.rank].clone()
    param = nn.Parameter(piece, requires_grad=full.requires_grad)
    setattr(param, SHARD_DIM, dim)
    return param


def sum_gradient_over(param: nn.Parameter, comm: Communicator) -> None:
    """Make ``param``'s gradient the sum over ``comm`` of the ranks' gradients (once per parameter).

    For a replicated parameter used on sequence shards: each rank sees ``1/t`` of the tokens, so its
    gradient is a partial sum. The hook runs on each incoming gradient before it is accumulated, so
    gradient accumulation and a data-parallel wrapper's hooks (after accumulation) see the full sum.
    """
    if comm.world_size == 1 or getattr(param, _SUMMED, False):
        return
    setattr(param, _SUMMED, True)
    param.register_hook(lambda grad: all_reduce_copy(grad, comm))


def leave_region(x: torch.Tensor, comm: Communicator, sequence_parallel: bool) -> torch.Tensor:
    """Sum row-parallel partial outputs, into sequence shards under sequence parallelism."""
    return scatter_to_sequence(x, comm) if sequence_parallel else reduce_from_region(x, comm)


class ColumnParallelLinear(nn.Module):
    """``in → out/t`` per rank; ``gather_output=True`` concatenates the ranks' outputs (all-gather).
    ``enter_region=False``: layers sharing one input already in the region (attention's q, k and v) pay
    one all-reduce backward for the three instead of three."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        comm: Communicator,
        *,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        enter_region: bool = True,
    ) -> None:
        """A layer over parameters that are already this rank's rows: :meth:`from_linear` cuts them from a
        whole layer, a head tied to an embedding passes the embedding's own."""
        super().__init__()
        if gather_output and sequence_parallel:
            raise ValueError("gather_output=True returns a replicated output; it cannot feed sequence shards")
        self.comm = comm
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0] * comm.world_size
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.enter_region = enter_region
        self.weight = weight
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: Communicator, **options: bool) -> ColumnParallelLinear:
        """The shard of an existing layer, so the parallel model computes exactly what ``linear`` did."""
        bias = shard_parameter(linear.bias, comm, 0) if linear.bias is not None else None
        return cls(shard_parameter(linear.weight, comm, 0), bias, comm, **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter_region and self.sequence_parallel:
            (y,) = gathered_linears(x, self.comm, [(self.weight, self.bias)])
        else:
            x = copy_to_region(x, self.comm) if self.enter_region else x
            y = F.linear(x, self.weight, self.bias)
        return gather_last(y, self.comm) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"({self.weight.shape[0]} on this rank of {self.comm.world_size}), "
            f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}"
        )


class RowParallelLinear(nn.Module):
    """``in/t → out`` partial sums per rank, reduced across the group; the bias is added after the sum.
    ``input_is_parallel=False`` takes a replicated input and keeps this rank's slice of it first."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        comm: Communicator,
        *,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
    ) -> None:
        """A layer over this rank's columns of the weight and the whole bias (:meth:`from_linear`)."""
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "sequence_parallel=True needs input_is_parallel=True (the output of a column layer)"
            )
        self.comm = comm
        self.in_features = weight.shape[1] * comm.world_size
        self.out_features = weight.shape[0]
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel
        self.weight = weight
        self.bias = bias
        if sequence_parallel and bias is not None:
            sum_gradient_over(bias, comm)  # added to sequence shards: a partial gradient

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: Communicator, **options: bool) -> RowParallelLinear:
        """The shard of an existing layer, so the parallel model computes exactly what ``linear`` did."""
        bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        return cls(shard_parameter(linear.weight, comm, 1), bias, comm, **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = split_last(x, self.comm)
        y = leave_region(F.linear(x, self.weight), self.comm, self.sequence_parallel)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.weight.shape[1]} on this rank of "
            f"{self.comm.world_size}), out_features={self.out_features}, "
            f"sequence_parallel={self.sequence_parallel}"
        )
