"""Language-model batches: train/validation split of a token stream and random windows of it.

A training sample is ``seq_len + 1`` consecutive tokens (inputs and the targets shifted by one) starting
at a random offset in the training part. The offsets of step s are drawn from a generator seeded with
``(seed, s)`` and cover the whole *global* batch; each data-parallel rank takes its contiguous slice of
them. So the global batch of a step is the same on any number of ranks — which is what makes a 3-rank
run comparable with a 1-rank run step by step — and a resumed run needs no sampler state: step s draws
what it would have drawn. Validation uses fixed windows evenly spread over the validation part.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

#: Fraction of the stream held out for validation (its end, so no window straddles both parts).
VAL_FRACTION = 0.1


@dataclass(frozen=True)
class TokenSplits:
    """A token stream cut into training and validation parts."""

    name: str
    train: np.ndarray
    val: np.ndarray

    @classmethod
    def split(cls, name: str, tokens: np.ndarray, seq_len: int) -> TokenSplits:
        cut = int(len(tokens) * (1 - VAL_FRACTION))
        splits = cls(name, tokens[:cut], tokens[cut:])
        for part, size in (("training", len(splits.train)), ("validation", len(splits.val))):
            if size < seq_len + 1:
                raise ValueError(
                    f"{name}: its {part} part has {size} tokens, fewer than one window of --seq-len "
                    f"{seq_len} + 1; use more data (≥ {(seq_len + 1) * 10} tokens) or a shorter --seq-len"
                )
        return splits

    def check_vocab(self, vocab: int) -> None:
        """Every token id must index the embedding table (one scan, before training starts)."""
        largest = int(max(self.train.max(), self.val.max()))
        if largest >= vocab:
            raise ValueError(
                f"{self.name} holds token id {largest} but the model's vocabulary is {vocab}: pass "
                f"--vocab {largest + 1} or more (or a config with a larger vocabulary)"
            )


def _windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([np.asarray(tokens[o : o + seq_len + 1], dtype=np.int64) for o in offsets])
    data = torch.from_numpy(rows)
    return data[:, :-1], data[:, 1:]


def global_offsets(size: int, seq_len: int, global_batch: int, seed: int, step: int) -> np.ndarray:
    """Start offsets of every window of step ``step``'s global batch (the same on every rank)."""
    generator = np.random.default_rng([seed, step])
    return generator.integers(0, size - seq_len, size=global_batch)


def train_batch(
    splits: TokenSplits, seq_len: int, global_batch: int, seed: int, step: int, rank: int, ranks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's slice (``global_batch / ranks`` windows) of step ``step``'s batch."""
    offsets = global_offsets(len(splits.train), seq_len, global_batch, seed, step)
    share = global_batch // ranks
    return _windows(splits.train, offsets[rank * share : (rank + 1) * share], seq_len)


def val_offsets(size: int, seq_len: int, windows: int) -> np.ndarray:
    """``windows`` fixed offsets spread evenly over the validation part (fewer if it is short)."""
    last = size - seq_len - 1
    return np.unique(np.linspace(0, last, num=min(windows, last + 1)).astype(np.int64))


def val_batches(
    splits: TokenSplits, seq_len: int, windows: int, batch: int, rank: int, ranks: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's share of the validation windows, in batches of at most ``batch``."""
    mine = val_offsets(len(splits.val), seq_len, windows)[rank::ranks]
    return [_windows(splits.val, mine[i : i + batch], seq_len) for i in range(0, len(mine), batch)]


def lockstep_val_batches(
    splits: TokenSplits, seq_len: int, windows: int, batch: int, rank: int, ranks: int
) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """This rank's validation batches (``counted`` True), padded with uncounted ones to as many as the
    busiest rank runs.

    A sharded model's forward is collective (ZeRO-3 gathers its parameters over the data-parallel
    ranks), so every rank must run the same number of forwards: with fewer windows than ranks, or a
    share that does not fill the last batch alike everywhere, a rank that stopped early would leave the
    others waiting in a gather. A padding batch is the first validation window; its loss is dropped."""
    offsets = val_offsets(len(splits.val), seq_len, windows)
    busiest = -(-len(offsets) // ranks)  # the first rank's share, the largest
    rounds = -(-busiest // batch)
    mine = [
        (inputs, targets, True)
        for inputs, targets in val_batches(splits, seq_len, windows, batch, rank, ranks)
    ]
    filler = _windows(splits.val, offsets[:1], seq_len)
    return mine + [(*filler, False)] * (rounds - len(mine))
