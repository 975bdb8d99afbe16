"""Which gradients share an all-reduce, and in which order: bucket planning as plain data.

Backward produces gradients roughly in reverse parameter order, so buckets fill walking the parameters
backwards: the first holds the last layers and is reduced while backward computes the early ones. As in
torch's DDP a bucket closes once it reaches its cap (overshooting by at most one tensor), the first of
each dtype/device with a small cap (1 MiB) so communication starts early and the rest a large one
(25 MiB) so latency is paid rarely; a bucket holds one dtype on one device, being reduced as one flat
tensor. The plan depends only on the parameter list, so every rank computes the same buckets in the same
order without talking: the order the all-reduces are issued in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MIB = 1 << 20


@dataclass(frozen=True)
class Bucket:
    """One all-reduce: parameters (positions in the parameter list) laid out back to back."""

    index: int
    params: tuple[int, ...]  # in gradient-ready order (reverse parameter order)
    offsets: tuple[int, ...]  # element offset of each parameter in the bucket's flat buffer
    numel: int
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def plan_buckets(params: Sequence[torch.Tensor], bucket_bytes: int, first_bucket_bytes: int) -> list[Bucket]:
    """Buckets for ``params`` (in module order), ordered by when their first gradient becomes ready."""
    if bucket_bytes <= 0 or first_bucket_bytes <= 0:
        raise ValueError(
            f"bucket caps must be positive, got bucket={bucket_bytes} B and "
            f"first bucket={first_bucket_bytes} B"
        )
    open_buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    seen_keys: set[tuple[torch.dtype, torch.device]] = set()
    closed: list[list[int]] = []
    for position in reversed(range(len(params))):
        tensor = params[position]
        key = (tensor.dtype, tensor.device)
        members = open_buckets.setdefault(key, [])
        members.append(position)
        open_bytes[key] = open_bytes.get(key, 0) + tensor.numel() * tensor.element_size()
        cap = bucket_bytes if key in seen_keys else first_bucket_bytes
        if open_bytes[key] >= cap:
            closed.append(members)
            seen_keys.add(key)
            del open_buckets[key], open_bytes[key]
    closed.extend(open_buckets.values())
    closed.sort(key=lambda members: -members[0])  # by the ready order of the bucket's first gradient
    buckets = []
    for index, members in enumerate(closed):
        offsets, total = [], 0
        for position in members:
            offsets.append(total)
            total += params[position].numel()
        first = params[members[0]]
        buckets.append(Bucket(index, tuple(members), tuple(offsets), total, first.dtype, first.device))
    return buckets
