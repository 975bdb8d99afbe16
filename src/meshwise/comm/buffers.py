"""Tensor memory layout for the backends: send list-form arguments as one buffer when possible.

MPI's vector collectives (``Allgatherv``, ``Alltoallv``, ...) and torch's ``all_to_all_single`` take one
buffer with counts and displacements. A list of slots that lie back to back in one storage (what
``chunk``/``split`` return, and what the Communicator's flat form produces) is that buffer already, so
it is passed without a copy; only lists of separate tensors are staged through one contiguous tensor and
copied out afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def adjacent_span(slots: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One 1-D view covering ``slots`` when they lie back to back in one storage, else None."""
    first = slots[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for slot in slots:
        if (
            slot.untyped_storage().data_ptr() != storage
            or slot.storage_offset() != offset
            or not slot.is_contiguous()
        ):
            return None
        offset += slot.numel()
    return torch.as_strided(first, (offset - first.storage_offset(),), (1,), first.storage_offset())


def joined(slots: Sequence[torch.Tensor]) -> torch.Tensor:
    """The slots as one contiguous 1-D tensor: a view when possible, a copy otherwise."""
    span = adjacent_span(slots)
    return span if span is not None else torch.cat([s.reshape(-1) for s in slots])


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() > 0 and a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


def scatter_back(flat: torch.Tensor, slots: Sequence[torch.Tensor]) -> Callable[[], None]:
    def finish() -> None:
        offset = 0
        for slot in slots:
            slot.view(-1).copy_(flat[offset : offset + slot.numel()])
            offset += slot.numel()

    return finish
