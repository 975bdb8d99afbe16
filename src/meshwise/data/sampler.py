"""Which samples each rank takes: a disjoint shard per rank, reshuffled every epoch.

The shuffle is a permutation drawn from ``seed + epoch``, identical on every rank without communication;
rank r takes every W-th index of it starting at r (W ranks), as torch's ``DistributedSampler`` does — with
the same seed and epoch both give the same shards. ``set_epoch`` must be called before each epoch, or
every epoch repeats the first one's order.

When W does not divide the dataset size n, the remainder rule decides:

- ``pad`` (default, for training): the permutation is extended with its own first ``W·⌈n/W⌉ − n`` indices,
  so each rank gets ⌈n/W⌉ samples and a few samples are seen twice per epoch. Every rank then runs the
  same number of steps, which data parallelism requires (a rank with one batch fewer would leave the
  others waiting in an all-reduce).
- ``drop``: the last ``n mod W`` indices of the permutation are left out; each rank gets ⌊n/W⌋ samples.
- ``uneven`` (for evaluation): every sample exactly once, ranks differing by at most one. Only safe when
  the per-rank results are combined by a reduction after the loop, as validation accuracy is.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

REMAINDERS = ("pad", "drop", "uneven")


class DistributedSampler:
    """Indices of rank ``rank``'s shard of a dataset of ``size`` samples over ``num_replicas`` ranks."""

    def __init__(
        self,
        size: int,
        num_replicas: int,
        rank: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        remainder: str = "pad",
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside 0..{num_replicas - 1}")
        if remainder not in REMAINDERS:
            raise ValueError(f"remainder={remainder!r} is unknown; use one of {REMAINDERS}")
        if size < 1 or (remainder == "drop" and size < num_replicas):
            raise ValueError(
                f"a dataset of {size} samples leaves ranks empty over {num_replicas} ranks "
                f"(remainder={remainder!r}); use more samples or fewer ranks"
            )
        self.size = size
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.remainder = remainder
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose permutation the next iteration uses."""
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}")
        self.epoch = epoch

    @property
    def total(self) -> int:
        """Samples taken by all ranks together in one epoch."""
        if self.remainder == "pad":
            return -(-self.size // self.num_replicas) * self.num_replicas
        if self.remainder == "drop":
            return self.size // self.num_replicas * self.num_replicas
        return self.size

    def __len__(self) -> int:
        return len(range(self.rank, self.total, self.num_replicas))

    def indices(self) -> torch.Tensor:
        """This rank's indices for the current epoch, as an int64 tensor."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=generator)
        else:
            order = torch.arange(self.size)
        if self.total > self.size:
            repeats = -(-(self.total - self.size) // self.size)
            order = torch.cat([order, order.repeat(repeats)[: self.total - self.size]])
        return order[self.rank : self.total : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint needs to continue with the same shuffles."""
        return {"seed": self.seed, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed = int(state["seed"])
        self.set_epoch(int(state["epoch"]))
