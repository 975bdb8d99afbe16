"""Cut a GPT into pipeline chunks: the embedding, contiguous runs of blocks, the final norm and head.

Chunk ``c`` of ``C = p·v`` holds blocks ``[start_c, end_c)``; chunk 0 also holds the token and position
embeddings, chunk ``C−1`` the final LayerNorm and the output head. Blocks are balanced by parameter count
(the embedding weighs on chunk 0 and the head's matmul on chunk C−1, so the end chunks get fewer blocks
when the vocabulary is large) or given explicitly.

The head is tied to the token embedding. When the first and last chunks live on different ranks each holds
its own copy of that matrix (same initial values); :func:`tied_parameters` names the pair so the executor
can sum their gradients after the backward, after which identical optimizer updates keep them equal — the
same arrangement Megatron-LM uses for its word embeddings.

Parameter names inside a chunk are the full model's (``blocks.3.attn.q.weight``, ``wte.weight``,
``head.weight``), so checkpoints and parity tests map chunk parameters to the model's one to one.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

from meshwise.models.gpt import GPT, language_model_loss
from meshwise.parallel.tensor_parallel.layers import SHARD_DIM, ColumnParallelLinear, shard_dim


class GPTChunk(nn.Module):
    """A contiguous slice of a GPT: ``forward`` maps tokens or hidden states to hidden states or logits."""

    def __init__(
        self,
        model: GPT,
        start: int,
        end: int,
        *,
        first: bool,
        last: bool,
        tied_here: bool,
        sequence_shards: int = 1,
    ) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.start, self.end = start, end
        self.config = model.config
        self.sequence_shards = sequence_shards
        if first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(start, end)})
        if last:
            self.ln_f = model.ln_f
            self.head = model.head if tied_here else _untied_head(model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = GPT.embed(self, x)  # type: ignore[arg-type]  # uses only wte, wpe, drop, config
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))
        return x

    def output_shape(self, input_shape: torch.Size) -> torch.Size:
        """Shape of the hidden states this chunk hands to the next: (batch, seq, hidden), with ``seq`` this
        rank's shard of the sequence under sequence parallelism (the first chunk's embedding splits it)."""
        seq = input_shape[1] // self.sequence_shards if self.first else input_shape[1]
        return torch.Size([input_shape[0], seq, self.config.hidden])

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return language_model_loss(logits, targets)


def _untied_head(model: GPT) -> nn.Module:
    """The last stage's own copy of the head: a plain Linear, or this rank's vocabulary rows of a
    tensor-parallel one (the same slice of the tied matrix the first stage's embedding holds)."""
    weight = nn.Parameter(model.wte.weight.detach().clone())
    if isinstance(model.head, ColumnParallelLinear):
        setattr(weight, SHARD_DIM, shard_dim(model.wte.weight))
        head = model.head
        return ColumnParallelLinear.from_shards(
            weight, None, head.comm, sequence_parallel=head.sequence_parallel
        )
    head = nn.Linear(model.config.hidden, model.config.vocab, bias=False, device=weight.device)
    head.weight = weight
    return head


def block_weights(model: GPT) -> tuple[list[int], int, int]:
    """Parameters of each block, of the embedding end and of the head end (balancing weights)."""
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    embed = model.wte.weight.numel() + model.wpe.weight.numel()
    head = model.wte.weight.numel() + sum(p.numel() for p in model.ln_f.parameters())
    return blocks, embed, head


def balanced_split(
    weights: Sequence[int], chunks: int, *, first_extra: int = 0, last_extra: int = 0
) -> list[int]:
    """Blocks per chunk (contiguous, each ≥ 1) minimising the heaviest chunk; ties favour early chunks."""
    n = len(weights)
    check_layers(n, chunks)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def load(c: int, i: int, j: int) -> int:
        extra = (first_extra if c == 0 else 0) + (last_extra if c == chunks - 1 else 0)
        return prefix[j] - prefix[i] + extra

    # best[c][j]: smallest possible heaviest chunk when chunks 0..c-1 hold blocks [0, j)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = 0
    for c in range(1, chunks + 1):
        for j in range(c, n - (chunks - c) + 1):
            for i in range(c - 1, j):
                value = max(best[c - 1][i], load(c - 1, i, j))
                if value < best[c][j]:
                    best[c][j], cut[c][j] = value, i
    sizes, j = [], n
    for c in range(chunks, 0, -1):
        sizes.append(j - cut[c][j])
        j = cut[c][j]
    return sizes[::-1]


def check_layers(layers: int, chunks: int) -> None:
    if layers < chunks:
        raise ValueError(
            f"{layers} layers cannot be cut into {chunks} pipeline chunks (pp × virtual stages): every chunk "
            f"needs at least one block; lower --pp or --virtual-stages, or use a deeper model"
        )


def partition(
    model: GPT,
    stages: int,
    virtual_stages: int = 1,
    layers_per_chunk: Sequence[int] | None = None,
    *,
    in_place: bool = False,
    sequence_shards: int = 1,
) -> list[GPTChunk]:
    """Every chunk of ``model`` (chunk c runs on rank c % stages), cut from a copy of it.

    ``layers_per_chunk`` fixes the blocks of each chunk explicitly; by default they are balanced by
    parameter count. ``in_place=True`` cuts ``model`` itself: for a tensor-parallel model, whose layers
    hold a communicator that must not be copied. ``sequence_shards`` is the tp size under sequence
    parallelism (chunks then hand over their rank's shard of the sequence).
    """
    chunks = stages * virtual_stages
    layers = model.config.layers
    if layers_per_chunk is None:
        blocks, embed, head = block_weights(model)
        sizes = balanced_split(blocks, chunks, first_extra=embed, last_extra=head)
    else:
        sizes = list(layers_per_chunk)
        check_layers(layers, chunks)
        if len(sizes) != chunks or sum(sizes) != layers or min(sizes) < 1:
            raise ValueError(
                f"layers per chunk {sizes} must be {chunks} positive counts (pp × virtual stages) summing to "
                f"the model's {layers} layers"
            )
    if not in_place:
        model = copy.deepcopy(model)
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return [
        GPTChunk(
            model,
            a,
            b,
            first=c == 0,
            last=c == chunks - 1,
            tied_here=stages == 1,
            sequence_shards=sequence_shards,
        )
        for c, (a, b) in enumerate(bounds)
    ]


def chunks_of_rank(chunks: Sequence[GPTChunk], rank: int, stages: int) -> list[GPTChunk]:
    """The chunks rank ``rank`` runs, in order: ``rank``, ``rank + p``, ``rank + 2p`` …"""
    return list(chunks[rank::stages])


def chunk_parameters(chunks: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The distinct parameters of a rank's chunks, for its optimizer: with one stage the head of the last
    chunk *is* the embedding of the first, and an optimizer given it twice would step it twice."""
    return list({id(p): p for c in chunks for p in c.parameters()}.values())


def tied_parameters(local: Sequence[GPTChunk]) -> list[nn.Parameter]:
    """This rank's copies of the embedding/head matrix when the two ends are on different ranks."""
    firsts = [c for c in local if c.first]
    lasts = [c for c in local if c.last]
    if firsts and lasts:
        return []  # one rank holds both ends: the tie is a shared Parameter already
    return [c.wte.weight for c in firsts] + [c.head.weight for c in lasts]
