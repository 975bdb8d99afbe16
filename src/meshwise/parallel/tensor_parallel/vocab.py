"""Vocabulary-parallel embedding and cross-entropy: the (vocab × hidden) matrix split by rows.

The embedding and the tied head are the largest matrices of a small-hidden language model and the logits
its largest activation, so, as Megatron-LM, the vocabulary is split and the full logits never assembled:

- **embedding**: a rank looks up only its rows (zeros for other tokens); summing the ranks' outputs
  (all-reduce, or reduce-scatter into sequence shards) gives the embedding.
- **cross-entropy**: the softmax's max is an all-reduce MAX; the target's logit (on one rank), the sum of
  exponentials and (label smoothing) the sum of logits one all-reduce SUM. Backward is local: a rank's
  slice of ``softmax − one_hot`` from its saved softmax.

**Padding**: the vocabulary is padded to a multiple of ``t`` (GPT-2's 50,257 is prime to most sizes) with
zero rows that are never looked up and whose logits are masked to −∞, so they get no gradient and the model
computes exactly what the unpadded one does. Only as much as the split needs (not Megatron's 128·t), so
the shapes stay comparable with one process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshwise.comm.api import Communicator, ReduceOp
from meshwise.parallel.tensor_parallel.layers import SHARD_DIM, leave_region


def padded_vocab(vocab: int, tp: int) -> int:
    """The smallest multiple of ``tp`` that holds ``vocab`` rows."""
    return -(-vocab // tp) * tp


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows are split across the tensor-parallel ranks: ``weight`` is this rank's
    ``padded_vocab/t`` rows (:meth:`from_embedding`), ``vocab`` the true size. The output is the full
    embedding, replicated or as this rank's sequence shard."""

    def __init__(
        self, weight: nn.Parameter, vocab: int, comm: Communicator, *, sequence_parallel: bool
    ) -> None:
        super().__init__()
        self.vocab = vocab
        self.comm = comm
        self.sequence_parallel = sequence_parallel
        self.start = comm.rank * weight.shape[0]  # the padded vocabulary's rows [start, end) are this rank's
        self.end = self.start + weight.shape[0]
        self.weight = weight
        setattr(self.weight, SHARD_DIM, 0)

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, comm: Communicator, *, sequence_parallel: bool = False
    ) -> VocabParallelEmbedding:
        """This rank's rows of ``embedding`` (padded with zero rows to a multiple of ``t``)."""
        vocab, hidden = embedding.weight.shape
        padding = embedding.weight.new_zeros(padded_vocab(vocab, comm.world_size) - vocab, hidden)
        rows = torch.cat([embedding.weight.detach(), padding]).chunk(comm.world_size)[comm.rank]
        return cls(nn.Parameter(rows.clone()), vocab, comm, sequence_parallel=sequence_parallel)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.start) | (tokens >= self.end)
        local = F.embedding((tokens - self.start).masked_fill(outside, 0), self.weight)
        local = local.masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_region(local, self.comm, self.sequence_parallel)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab}, rows [{self.start}, {self.end}) of {self.comm.world_size} ranks"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        comm: Communicator,
        start: int,
        vocab: int,
        ignore_index: int,
        smoothing: float,
    ) -> torch.Tensor:
        logits = logits.float()
        local_vocab = logits.shape[-1]
        columns = torch.arange(start, start + local_vocab, device=logits.device)
        padded = columns >= vocab
        if padded.any():
            logits = logits.masked_fill(padded, float("-inf"))
        maximum = logits.max(dim=-1).values
        comm.all_reduce(maximum, ReduceOp.MAX)
        shifted = logits - maximum.unsqueeze(-1)
        ignored = targets == ignore_index
        mine = (targets >= start) & (targets < start + local_vocab) & ~ignored
        local_index = (targets - start).masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, local_index.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exp = shifted.exp()
        sums = torch.stack(
            [target_logit, exp.sum(dim=-1), shifted.masked_fill(padded, 0.0).sum(dim=-1)], dim=0
        )
        comm.all_reduce(sums)
        target_logit, sum_exp, sum_logits = sums.unbind(0)
        log_z = sum_exp.log()
        loss = log_z - target_logit
        if smoothing:
            # F.cross_entropy's smoothing: (1-ε)·nll + ε·mean over the vocabulary of -log p_j
            loss = (1 - smoothing) * loss + smoothing * (log_z - sum_logits / vocab)
        loss = loss.masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_index, mine, ignored, padded)
        ctx.smoothing, ctx.vocab = smoothing, vocab
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, local_index, mine, ignored, padded = ctx.saved_tensors
        grad_logits = softmax
        if ctx.smoothing:
            grad_logits = grad_logits - (ctx.smoothing / ctx.vocab) * (~padded).to(softmax.dtype)
        one_hot = F.one_hot(local_index, softmax.shape[-1]).to(softmax.dtype) * mine.unsqueeze(-1)
        grad_logits = grad_logits - (1 - ctx.smoothing) * one_hot
        grad_logits = grad_logits * grad.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad_logits, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    comm: Communicator,
    *,
    vocab: int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy`` of logits split along the vocabulary, without gathering them.

    ``logits`` is (..., V_local): this rank's slice ``[rank·V_local, (rank+1)·V_local)`` of the padded
    vocabulary; ``targets`` (...) holds global token ids, the same on every rank of ``comm``. ``vocab`` is
    the true vocabulary size (columns at or past it are padding and ignored); it defaults to all columns.
    ``reduction`` is ``"mean"`` (over non-ignored targets, as torch), ``"sum"`` or ``"none"``.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} is unknown; use 'mean', 'sum' or 'none'")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    local_vocab = logits.shape[-1]
    vocab = vocab if vocab is not None else local_vocab * comm.world_size
    if not 0 < vocab <= local_vocab * comm.world_size:
        raise ValueError(f"vocab={vocab} does not fit {comm.world_size} shards of {local_vocab} columns")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree")
    losses = _VocabParallelCrossEntropy.apply(
        logits, targets, comm, comm.rank * local_vocab, vocab, ignore_index, label_smoothing
    )
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (targets != ignore_index).sum()
