"""Training checkpoints: one file per run directory, replaced atomically after every epoch.

``DIR/checkpoint.pt`` is a ``torch.save`` dictionary readable with ``torch.load(weights_only=True)``:

=================  =====================================================================================
format             ``"meshwise-train/1"``
model              workload name (``mlp``, ``deep-mlp``, ``cnn``)
dataset            what it was trained on (``digits``, ``mnist``, ``clusters-6d``): a resume on other data
                   is refused by name rather than failing on a tensor shape
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

import io
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from meshwise.runtime.env import detect_launch_env

FORMAT = "meshwise-train/1"
FILENAME = "checkpoint.pt"
#: what a resume reads; a file without one of them is not a usable checkpoint
KEYS = ("model", "epoch", "model_state", "optimizer_state", "sampler", "rng", "run", "history")


def checkpoint_file(directory: str | Path) -> Path:
    return Path(directory) / FILENAME


def check_writable(directory: str | Path) -> None:
    """Create ``directory`` if needed and write a scratch file in it, so that a path that cannot take a
    checkpoint is refused before training rather than after the first epoch. A real write is the only
    test that also holds for root, read-only mounts and full disks; raises ValueError saying what to do."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory) as probe:
            probe.write(b"meshwise")
            probe.flush()
    except OSError as exc:
        raise ValueError(
            f"--checkpoint {directory} is not writable ({exc.strerror or exc}); choose another directory"
        ) from None


def save_checkpoint(directory: str | Path, state: dict[str, Any]) -> Path:
    """Write ``state`` atomically (temp file, fsync, rename) and return the checkpoint's path.

    The state is serialised in memory first: ``torch.save`` on a file that fails mid-write (full disk)
    raises an opaque ``RuntimeError`` from its C++ writer, whereas a plain write raises ``OSError`` with
    the errno the caller turns into a sentence. A write failure leaves the previous checkpoint intact.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = checkpoint_file(directory)
    temporary = directory / f".{FILENAME}.{os.getpid()}.tmp"
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, **state}, buffer)
    try:
        with open(temporary, "wb") as handle:
            handle.write(buffer.getbuffer())
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
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is empty: not a meshwise checkpoint (truncated or corrupt)")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception:  # torch raises several types, with pages of advice, for truncated or foreign files
        raise ValueError(f"{path} is not a meshwise checkpoint (truncated or corrupt)") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a meshwise training checkpoint (format {FORMAT!r} expected)")
    missing = [key for key in KEYS if key not in state]
    if missing:
        raise ValueError(f"{path} is not a complete meshwise checkpoint (no {', '.join(missing)})")
    return state


def checkpoint_directory(checkpoint: str | None, resume: bool) -> Path | None:
    """The ``--checkpoint``/``--resume`` checks every trainer makes first: None when no checkpoint is
    asked for, else the directory (which, if it exists, is one)."""
    if checkpoint is None:
        if resume:
            raise ValueError("--resume needs --checkpoint DIR: the directory of the run to continue")
        return None
    directory = Path(checkpoint)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"--checkpoint {directory} is a file; pass a directory")
    return directory


def resume_requested(checkpoint: str | None, resume: bool) -> bool:
    """``--resume``, or implied by a restart: when a launcher restarted the job after a failure
    (``meshwise run --max-restarts``, torchrun, SLURM requeue) and the run already wrote a checkpoint,
    the restarted ranks continue from it instead of refusing to overwrite it."""
    if resume or checkpoint is None or detect_launch_env().restart_count == 0:
        return resume
    return checkpoint_file(checkpoint).exists()
