"""``apply_context_parallel(model, cp_comm)``: make a model run on this rank's chunks of every sequence.

In place, on every rank of the cp group (same weights on each: context parallelism splits activations,
not parameters): each attention's core (every :class:`~meshwise.parallel.protocols.SplitAttention`)
becomes :func:`.attention.context_parallel_attention` over ``cp_comm`` — composing with tensor parallelism
(fewer heads reach the core) and selective recomputation (which re-runs it, collective included) — and the
position table returns the rows of the rank's tokens (:func:`.chunks.local_positions`), the model being
fed ``split_sequence(tokens, cp, rank)``. Every rank holds as many tokens, so the group's mean loss is the
mean of the ranks', and its gradient the mean of theirs: in training cp ranks join data parallelism's
gradient average; :func:`group_mean` and :func:`average_gradients` do the cp part alone.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from meshwise.comm.api import Communicator, ReduceOp
from meshwise.parallel.context_parallel.attention import context_parallel_attention
from meshwise.parallel.context_parallel.chunks import check_context_parallel, local_positions
from meshwise.parallel.protocols import SplitAttention, split_attentions


class ContextParallelCore:
    """An attention's ``core(q, k, v)`` over the cp group, with the attention's dropout."""

    def __init__(self, attention: SplitAttention, comm: Communicator) -> None:
        self.attention, self.comm = attention, comm

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout = self.attention.dropout if self.attention.training else 0.0
        return context_parallel_attention(q, k, v, self.comm, dropout)


class ContextParallelPositions(nn.Embedding):
    """The position table (the same Parameter, under its plain name), looked up at this rank's positions.

    The lookup is the replaced table's own ``forward``, kept as a bound method rather than a submodule so
    the name stays ``wpe.weight``; under sequence parallelism it returns this tp rank's shard of the cp
    rank's tokens (cp chooses the tokens, sp splits them)."""

    def __init__(self, full: nn.Embedding, comm: Communicator) -> None:
        super().__init__(*full.weight.shape, device="meta")
        self.weight = full.weight
        self.lookup = full.forward
        self.comm = comm

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        seq = positions.shape[-1] * self.comm.world_size  # the model sees its local tokens 0..s/cp-1
        check_context_parallel(seq, self.comm.world_size, self.num_embeddings)
        return self.lookup(local_positions(seq, self.comm.world_size, self.comm.rank, positions.device))


def apply_context_parallel(model: nn.Module, cp_comm: Communicator, positions: str = "wpe") -> nn.Module:
    """Convert ``model`` (a GPT, a pipeline stage, a tensor-parallel GPT) in place (module docstring).

    ``positions`` names the model's learned absolute position table (GPT-2's name by default); a model
    without one there (rotary or no positions) has none to convert."""
    if cp_comm.world_size == 1:
        return model
    attentions = split_attentions(model)
    if any(isinstance(a.__dict__.get("core"), ContextParallelCore) for a in attentions):
        raise ValueError("this model is already context parallel")
    for attention in attentions:
        attention.core = ContextParallelCore(attention, cp_comm)  # type: ignore[method-assign]
    table = getattr(model, positions, None)
    if isinstance(table, nn.Embedding):
        setattr(model, positions, ContextParallelPositions(table, cp_comm))
    return model


def group_mean(local_mean: torch.Tensor | float, comm: Communicator) -> float:
    """The mean over the group's tokens of a per-rank mean over equally many tokens (for reporting)."""
    value = torch.tensor([float(torch.as_tensor(local_mean).detach())], dtype=torch.float64)
    comm.all_reduce(value, ReduceOp.AVG)
    return value.item()


def average_gradients(parameters: Iterable[nn.Parameter], comm: Communicator) -> None:
    """Average ``.grad`` over the group in place: the gradient of the group-mean loss."""
    for param in parameters:
        if param.grad is not None:
            comm.all_reduce(param.grad, ReduceOp.AVG)
