"""Training checkpoints: one file per run directory, replaced atomically after every epoch.

``DIR/checkpoint.pt`` is a ``torch.save`` dictionary readable with ``torch.load(weights_only=True)``:

=================  =====================================================================================
format             ``"meshwise-train/1"``
model              workload name (``mlp``, ``deep-mlp``, ``cnn``)
epoch              epochs completed; a resumed run starts at this epoch
strategy           ``ddp`` or ``zero1``/``zero2``/``zero3`` (a run resumes with the one it was written by)
shards             ZeRO: the sibling directory holding every rank's shards (torch.distributed.checkpoint,
                   see meshwise.parallel.zero.checkpoint); None for ddp
model_state        ddp: the plain model's ``state_dict`` (no ``module.`` prefix); None for ZeRO
optimizer_state    ddp: the optimizer's ``state_dict``; None for ZeRO
sampler            the training sampler's seed and epoch
rng                rank 0's torch CPU generator state
run                world_size, batch_size (per rank), base_lr, lr (after scaling), seed, epochs
history            one dict of metrics per completed epoch
=================  =====================================================================================

Rank 0 writes to a temporary file in the same directory and renames it over the old checkpoint, so a job
killed mid-write leaves the previous epoch's checkpoint intact, never a truncated one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

FORMAT = "meshwise-train/1"
FILENAME = "checkpoint.pt"


def checkpoint_file(directory: str | Path) -> Path:
    return Path(directory) / FILENAME


def save_checkpoint(directory: str | Path, state: dict[str, Any]) -> Path:
    """Write ``state`` atomically (temp file, fsync, rename) and return the checkpoint's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = checkpoint_file(directory)
    temporary = directory / f".{FILENAME}.{os.getpid()}.tmp"
    try:
        with open(temporary, "wb") as handle:
            torch.save({"format": FORMAT, **state}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def read_checkpoint(directory: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The checkpoint in ``directory``; a clear error when it is missing or is not one of ours."""
    path = checkpoint_file(directory)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: nothing to resume")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises several types for truncated or foreign files
        raise ValueError(f"{path} is not a readable checkpoint: {exc}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a meshwise training checkpoint (format {FORMAT!r} expected)")
    return state
