"""Causal attention over a sequence split across a context-parallel group (an all-gather design).

Each rank holds the queries, keys and values of its two chunks (:mod:`.chunks`). Forward: the ranks
all-gather keys and values (one collective for both), reorder them into sequence order, and each of the
rank's query chunks ``g`` attends to the keys of chunks ``0..g`` with the causal mask of its own diagonal
block — ``2N + 1`` chunk-pairs of work on every rank, in memory linear in the sequence (:mod:`.blockwise`).
Backward: the gradient of an all-gather is a
reduce-scatter, so every rank's contributions to each key and value are summed onto the rank that owns it
(:func:`~meshwise.parallel.tensor_parallel.gather_from_sequence`, the same conjugate pair sequence
parallelism uses). Queries never leave their rank, so dQ needs no communication.

Correct gradients are the bar here: ring-attention implementations have shipped a right forward with wrong
dK/dV. The tests compare output, dQ, dK and dV with one-process attention for cp 2, 3 and 4.

Memory: the gathered keys and values are the whole sequence's (``2·s·h`` values per layer); a ring that
passes them chunk by chunk, overlapping transfer with compute, would keep two chunks — a later step.
"""

from __future__ import annotations

import torch

from meshwise.comm.api import Communicator
from meshwise.parallel.context_parallel.blockwise import chunk_attention
from meshwise.parallel.context_parallel.chunks import chunk_indices, gathered_positions
from meshwise.parallel.tensor_parallel.regions import gather_from_sequence


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
    c, seq = local // 2, local * cp
    kv = gather_from_sequence(torch.stack((k, v)), comm, dim=-2)  # (2, b, heads, seq, d), rank order
    order = torch.argsort(gathered_positions(seq, cp, q.device))
    keys, values = kv.index_select(-2, order).unbind(0)  # sequence order
    outputs = []
    for half, g in enumerate(chunk_indices(comm.rank, cp)):
        visible = (g + 1) * c  # keys of chunks 0..g; the last c are the query chunk's own
        query = q[..., half * c : (half + 1) * c, :]
        outputs.append(chunk_attention(query, keys[..., :visible, :], values[..., :visible, :], dropout_p))
    return torch.cat(outputs, dim=-2)
