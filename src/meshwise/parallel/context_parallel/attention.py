"""Causal attention over a sequence split across a context-parallel group (an all-gather design).

Each rank holds the queries, keys and values of its two chunks (:mod:`.chunks`). Forward: the ranks
all-gather keys and values (one collective for both), put them in sequence order, and each query chunk
``g`` attends to the keys of chunks ``0..g`` (:mod:`.blockwise`, memory linear in the sequence). Backward:
the all-gather's gradient is a reduce-scatter (``gather_from_sequence``, sequence parallelism's pair),
summing every rank's contributions to a key or value onto its owner; queries never leave their rank, so
dQ needs no communication.

With the fused CPU kernel the gathered keys and values (the whole sequence's) are not kept: the rank's own
are, and gathered again in backward — one more all-gather per layer instead of holding the sequence. On
the explicit-mask path (other devices, attention dropout) autograd keeps the gathered ones. Ring-attention
implementations have shipped a right forward with wrong dK/dV: the tests compare output, dQ, dK and dV
with one-process attention for cp 2, 3 and 4.
"""

from __future__ import annotations

from typing import Any

import torch

from meshwise.comm.api import Communicator
from meshwise.parallel.context_parallel.blockwise import (
    fused_available,
    fused_backward,
    fused_forward,
    masked_attention,
)
from meshwise.parallel.context_parallel.chunks import chunk_indices, gathered_positions
from meshwise.parallel.tensor_parallel.regions import gather_along, gather_from_sequence


def context_parallel_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator, dropout_p: float = 0.0
) -> torch.Tensor:
    """softmax(q·kᵀ/√d + causal mask)·v for this rank's chunks; (batch, heads, local seq, head_dim) each.

    Every rank of ``comm`` must call it (the key/value all-gather is collective).
    """
    cp = comm.world_size
    local = q.shape[-2]
    if local % 2:
        raise ValueError(
            f"[rank {comm.rank} · context parallel attention] {local} local tokens are not two equal chunks"
        )
    order = torch.argsort(gathered_positions(local * cp, cp, q.device))
    mine = torch.stack((k, v))
    kv = gather_from_sequence(mine, comm, dim=-2).index_select(-2, order)  # (2, b, heads, s, d) in order
    if fused_available(q, dropout_p):
        return _RegatheringAttention.apply(q, kv, mine.detach(), comm, order)
    c = local // 2
    outputs = []
    for half, g in enumerate(chunk_indices(comm.rank, cp)):
        visible = (g + 1) * c  # keys of chunks 0..g; the last c are the query chunk's own
        query = q[..., half * c : (half + 1) * c, :]
        outputs.append(masked_attention(query, kv[0, ..., :visible, :], kv[1, ..., :visible, :], dropout_p))
    return torch.cat(outputs, dim=-2)


class _RegatheringAttention(torch.autograd.Function):
    """The fused path: keeps q, this rank's k and v, the output and log-sum-exp; gathers k, v again in
    backward. Its gradient for the gathered ``kv`` flows back through the all-gather (reduce-scatter)."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        kv: torch.Tensor,
        mine: torch.Tensor,
        comm: Communicator,
        order: torch.Tensor,
    ) -> torch.Tensor:
        batch, heads, local, dim = q.shape
        c = local // 2
        # (batch, seq, heads, dim) memory seen as (batch, heads, seq, dim): the output projection's
        # transpose back is then a view, so the output is kept once (not once more by that projection)
        out = q.new_empty(batch, local, heads, dim).transpose(1, 2)
        lse = q.new_empty(batch, heads, local, dtype=torch.float32)  # the kernel keeps it in fp32
        for half, g in enumerate(chunk_indices(comm.rank, comm.world_size)):
            rows = slice(half * c, (half + 1) * c)
            visible = (g + 1) * c
            out[..., rows, :], lse[..., rows] = fused_forward(
                q[..., rows, :], kv[0, ..., :visible, :], kv[1, ..., :visible, :]
            )
        ctx.comm, ctx.order = comm, order
        ctx.save_for_backward(q, mine, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, mine, out, lse = ctx.saved_tensors
        comm = ctx.comm
        kv = gather_along(mine, comm, -2).index_select(-2, ctx.order)
        c = q.shape[-2] // 2
        dq = torch.empty_like(q)
        dkv = torch.zeros_like(kv)
        for half, g in enumerate(chunk_indices(comm.rank, comm.world_size)):
            rows = slice(half * c, (half + 1) * c)
            visible = (g + 1) * c
            dq[..., rows, :], dk, dv = fused_backward(
                grad[..., rows, :],
                q[..., rows, :],
                kv[0, ..., :visible, :],
                kv[1, ..., :visible, :],
                out[..., rows, :],
                lse[..., rows],
            )
            dkv[0, ..., :visible, :] += dk
            dkv[1, ..., :visible, :] += dv
        return dq, dkv, None, None, None
