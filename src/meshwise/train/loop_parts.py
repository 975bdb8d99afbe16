"""What both training loops do alike: ``train mlp|cnn|deep-mlp``'s :mod:`meshwise.train.loop` (epochs) and
``train gpt``'s :mod:`meshwise.train.gpt.loop` (steps).

Each loop keeps only what is its own; here are the pieces where the two must behave the same: rank 0's
progress bar, the agreements every rank reaches together (is it true on every rank, which ranks diverged
first) and a checkpoint write whose failure on any rank (a full disk, DCP's own error) stops every rank at
once with one sentence naming what is left on disk, instead of leaving peers waiting in a collective.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import torch
from rich import progress
from rich.console import Console
from torch.distributed.checkpoint.api import CheckpointException

from meshwise.comm.api import ReduceOp
from meshwise.train import checkpoint
from meshwise.train.errors import TrainingError, diverged_on
from meshwise.world import World


def progress_bar(world: World, console: Console, *columns: progress.ProgressColumn) -> progress.Progress:
    """Rank 0's transient bar (description, bar, done of total, time left, then ``columns``), drawn only
    on a terminal: a batch job's log keeps the plain lines the loops print beside it."""
    return progress.Progress(
        progress.TextColumn("{task.description}"),
        progress.BarColumn(),
        progress.MofNCompleteColumn(),
        progress.TimeRemainingColumn(),
        *columns,
        console=console,
        transient=True,
        disable=not (world.is_main and console.is_terminal),
    )


def everywhere(world: World, ok: bool) -> bool:
    """Collective: whether ``ok`` holds on every rank (one all-reduce)."""
    failed = torch.tensor([0.0 if ok else 1.0], device=world.device)
    world.comm.all_reduce(failed, ReduceOp.MAX)
    return not failed.item()


def first_diverged(world: World, first_step: int) -> tuple[int, str]:
    """Collective: :func:`~meshwise.train.errors.diverged_on` over every rank's ``first_step`` (1-based,
    the first whose own loss was non-finite; 0: none). Called once a reduced value is non-finite, so every
    rank calls it together."""
    first_steps = torch.zeros(world.world_size, dtype=torch.float64, device=world.device)
    first_steps[world.rank] = first_step
    world.comm.all_reduce(first_steps, ReduceOp.SUM)
    return diverged_on([int(step) for step in first_steps.tolist()])


def kept(what: str, number: int) -> str:
    """What a failure leaves on disk: the ``what``-``number`` checkpoint (``epoch``, ``step``), or none."""
    return f"the {what}-{number} checkpoint is kept" if number else "no checkpoint was written"


def save_everywhere(
    world: World, directory: str, left: str, step: int, state: dict, run: dict, **how: Any
) -> Path:
    """Collective: :func:`meshwise.train.checkpoint.save` of ``step`` (``how``: format, keep) on every
    rank, then every rank learns whether that worked on all of them. A failure anywhere raises the same
    :class:`TrainingError` on every rank: one sentence ending in ``left``, what is on disk instead."""
    error: str | None = None
    path = Path(directory)
    try:
        path = checkpoint.save(
            directory, step, state, run, is_main=world.is_main, barrier=world.comm.barrier, **how
        )
    except (OSError, CheckpointException) as failure:
        exc: BaseException = failure
        if isinstance(exc, CheckpointException):  # DCP gathers every rank's error with its traceback
            exc = next((cause for cause, _trace in exc.failures.values()), exc)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        error = f"cannot write the checkpoint in {directory} ({reason}); {left}"
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            error = f"no space left on device for the checkpoint in {directory}; {left}"
    if not everywhere(world, error is None):
        raise TrainingError(error or f"another rank could not write its part of the checkpoint; {left}")
    return path
