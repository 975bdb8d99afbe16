"""GPT checkpoints: the one DCP layout of :mod:`meshwise.train.checkpoint` (read that for why and how),
under the format ``meshwise-gpt/2``.

The DCP checkpoint holds ``model`` and ``optim`` (by the plain model's names), the strategy's own state
(``scaler``: fp16's loss scale) and ``rng``: each rank's random streams under its mesh coordinates
(:mod:`meshwise.train.random_state`), written by that rank alone. ``run.json`` holds, besides ``format``
and ``step``:

================  ======================================================================================
model             the GPT's config (a resume of another model is refused before launch)
run               global_batch, seed, steps, config, train_seq_len
world_size        ranks that wrote it
mesh              the layout that wrote it (``{"pp": 1, "dp": 2, ...}``): the random streams are restored
                  only on the same one (another continues deterministically, re-derived)
data              the data position: ``next_step`` (the first step a resume trains), the sampler's
                  ``seed``, ``global_batch`` and ``seq_len``. The sampler (:func:`~meshwise.data.windows.
                  train_batch`) is a pure function of these and the step, so this is all its state
initial_val_loss  the validation loss before the first step
history           one record per completed step
================  ======================================================================================

``meshwise-gpt/1`` (written before ``mesh``, ``data`` and ``rng``) is still read: its run continues with
the data position of its ``step`` and random streams re-derived as on another layout — exact without
``--dropout``, deterministic with it. A format this meshwise does not know is refused in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshwise.train import checkpoint
from meshwise.train.checkpoint import RUN_FILE, stale_steps, step_dir

FORMAT = "meshwise-gpt/2"
#: the formats a resume reads, newest first
READS = (FORMAT, "meshwise-gpt/1")
__all__ = ["FORMAT", "READS", "RUN_FILE", "load", "read_run", "save", "stale_steps", "step_dir"]


def read_run(directory: str | Path) -> dict[str, Any]:
    """``DIR/run.json``, or a clear error when there is nothing (of ours) to resume."""
    return checkpoint.read_run(directory, READS, "GPT ")


def save(directory: str | Path, step: int, state: dict[str, Any], run: dict[str, Any], **how: Any) -> Path:
    """Collective: :func:`meshwise.train.checkpoint.save` (``how``: is_main, barrier, keep)."""
    return checkpoint.save(directory, step, state, run, format=FORMAT, **how)


def load(directory: str | Path, state: dict[str, Any]) -> dict[str, Any]:
    """Fill ``state`` (tensors in place) from the checkpoint run.json names; return run.json."""
    return checkpoint.load(directory, state, READS, "GPT ")


def data_position(seed: int, global_batch: int, seq_len: int, next_step: int) -> dict[str, int]:
    """run.json's ``data``: where the training data continues (see the module docstring)."""
    return {"seed": seed, "global_batch": global_batch, "seq_len": seq_len, "next_step": next_step}


def next_step(run: dict[str, Any]) -> int:
    """The first step a resume of ``run`` trains: its data position (a ``meshwise-gpt/1`` run.json, which
    has none, continues after its ``step``)."""
    position = run.get("data")
    return int(position["next_step"]) if position is not None else int(run["step"])
