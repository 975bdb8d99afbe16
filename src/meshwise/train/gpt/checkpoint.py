"""GPT checkpoints: the one DCP layout of :mod:`meshwise.train.checkpoint` (read that for why and how),
under the format ``meshwise-gpt/1``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshwise.train import checkpoint
from meshwise.train.checkpoint import RUN_FILE, stale_steps, step_dir

FORMAT = "meshwise-gpt/1"
__all__ = ["FORMAT", "RUN_FILE", "load", "read_run", "save", "stale_steps", "step_dir"]


def read_run(directory: str | Path) -> dict[str, Any]:
    """``DIR/run.json``, or a clear error when there is nothing (of ours) to resume."""
    return checkpoint.read_run(directory, FORMAT, "GPT ")


def save(directory: str | Path, step: int, state: dict[str, Any], run: dict[str, Any], **how: Any) -> Path:
    """Collective: :func:`meshwise.train.checkpoint.save` (``how``: is_main, barrier, keep)."""
    return checkpoint.save(directory, step, state, run, format=FORMAT, **how)


def load(directory: str | Path, state: dict[str, Any]) -> dict[str, Any]:
    """Fill ``state`` (tensors in place) from the checkpoint run.json names; return run.json."""
    return checkpoint.load(directory, state, FORMAT, "GPT ")
