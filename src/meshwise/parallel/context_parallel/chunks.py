"""Which tokens a context-parallel rank holds: plain arithmetic, testable without processes.

``s`` tokens over ``N`` ranks are cut into ``2N`` chunks of ``c = s / 2N``; rank ``r`` holds chunks ``r``
and ``2N − 1 − r``. A query in chunk ``g`` attends to ``g + 1`` chunks of keys, so every rank does
``(r + 1) + (2N − r) = 2N + 1`` chunk-pairs of causal attention, where contiguous ``N``-ths of the
sequence would give the last rank ``2N − 1`` times the first one's work.
"""

from __future__ import annotations

import torch


def check_context_parallel(seq_len: int, cp: int, positions: int | None = None) -> None:
    """Raise ``ValueError`` saying what to change when ``seq_len`` tokens cannot be split over ``cp`` ranks
    (``positions``: the model's position table, which the whole sequence must fit)."""
    if cp < 1:
        raise ValueError(f"--cp must be at least 1, got {cp}")
    if seq_len % (2 * cp):
        multiple = 2 * cp
        below = seq_len // multiple * multiple
        raise ValueError(
            f"context parallelism cuts each sequence into 2·cp = {multiple} equal chunks: --seq-len "
            f"{seq_len} is not a multiple of {multiple}; use {below or multiple} or {below + multiple}"
        )
    if positions is not None and seq_len > positions:
        raise ValueError(
            f"a sequence of {seq_len} tokens is longer than the position table ({positions}): context "
            f"parallelism splits the work, not the positions; lower --seq-len or use a model with a longer "
            "one"
        )


def chunk_indices(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of ``2·cp``) rank ``rank`` holds, in the order it holds them."""
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions in the whole sequence of rank ``rank``'s ``seq_len / cp`` tokens, in local order."""
    check_context_parallel(seq_len, cp)
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(g * c, (g + 1) * c, device=device) for g in chunk_indices(rank, cp)])


def gathered_positions(seq_len: int, cp: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions of the tokens of an all-gather over the cp ranks (rank order, each rank's local order)."""
    return torch.cat([local_positions(seq_len, cp, r, device) for r in range(cp)])


def split_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s tokens of a whole-sequence tensor (tokens, targets, hidden states) along ``dim``."""
    if cp == 1:
        return x
    return x.index_select(dim, local_positions(x.shape[dim], cp, rank, x.device))


def merge_sequence(pieces: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole-sequence tensor from every rank's :func:`split_sequence` piece (rank order)."""
    cp = len(pieces)
    gathered = torch.cat(pieces, dim=dim)
    order = torch.argsort(gathered_positions(gathered.shape[dim], cp, gathered.device))
    return gathered.index_select(dim, order)
