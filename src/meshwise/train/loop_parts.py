"""What both training loops do alike: ``train mlp|cnn|deep-mlp``'s :mod:`meshwise.train.loop` (epochs) and
``train gpt``'s :mod:`meshwise.train.gpt.loop` (steps) are each a :class:`Lifecycle`.

Each loop keeps only what is its own; here is where the two must behave the same: rank 0's banner and
progress bar, the agreements every rank reaches together (is it true on every rank, which ranks diverged
first), restoring a checkpoint into the step, and a checkpoint write whose failure on any rank (a full
disk, DCP's own error) stops every rank at once with one sentence naming what is left on disk, instead of
leaving peers waiting in a collective.
"""

from __future__ import annotations

import errno
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from rich import progress
from rich.console import Console
from torch.distributed.checkpoint.api import CheckpointException

from meshwise.comm.api import ReduceOp
from meshwise.train import checkpoint
from meshwise.train.errors import TrainingError, diverged_on
from meshwise.train.step import ParallelStep
from meshwise.world import World


class Lifecycle:
    """One rank's run around its steps: the checkpoints it writes and restores, its banner and bar."""

    #: what the run counts (``epoch``, ``step``): names the checkpoint a failure leaves on disk
    unit: str
    #: the record of one epoch or step: the history, kept in run.json as dicts
    stats: type
    step_runner: ParallelStep

    def __init__(self, world: World, directory: str | None) -> None:
        self.world, self.directory = world, directory
        self.console = Console(soft_wrap=True)
        self.checkpoint: str | None = None  # path of the last checkpoint written
        self.kept = 0  # the epoch or step of the checkpoint on disk: what a failure leaves behind
        self.history: list[Any] = []

    @property
    def left(self) -> str:
        """What a failure leaves on disk: the kept checkpoint, or none."""
        return f"the {self.unit}-{self.kept} checkpoint is kept" if self.kept else "no checkpoint was written"

    def ranks(self) -> str:
        """The banner's ``2 ranks × cpu over gloo``."""
        world = self.world
        plural = "s" if world.world_size > 1 else ""
        return f"{world.world_size} rank{plural} × {world.device} over {world.backend}"

    def progress_bar(self, *columns: progress.ProgressColumn) -> progress.Progress:
        """Rank 0's transient bar (description, bar, done of total, time left, then ``columns``), drawn
        only on a terminal: a batch job's log keeps the plain lines the loops print beside it."""
        return progress.Progress(
            progress.TextColumn("{task.description}"),
            progress.BarColumn(),
            progress.MofNCompleteColumn(),
            progress.TimeRemainingColumn(),
            *columns,
            console=self.console,
            transient=True,
            disable=not (self.world.is_main and self.console.is_terminal),
        )

    def everywhere(self, ok: bool) -> bool:
        """Collective: whether ``ok`` holds on every rank (one all-reduce)."""
        failed = torch.tensor([0.0 if ok else 1.0], device=self.world.device)
        self.world.comm.all_reduce(failed, ReduceOp.MAX)
        return not failed.item()

    def first_diverged(self, first_step: int) -> tuple[int, str]:
        """Collective: :func:`~meshwise.train.errors.diverged_on` over every rank's ``first_step`` (1-based,
        the first whose own loss was non-finite; 0: none). Called once a reduced value is non-finite, so
        every rank calls it together."""
        world = self.world
        first_steps = torch.zeros(world.world_size, dtype=torch.float64, device=world.device)
        first_steps[world.rank] = first_step
        world.comm.all_reduce(first_steps, ReduceOp.SUM)
        return diverged_on([int(step) for step in first_steps.tolist()])

    def load(self, run: dict[str, Any], state: dict[str, Any]) -> None:
        """Fill ``state`` (the step's, plus what the loop adds) from the checkpoint ``run`` (its run.json,
        read and checked) names, written by any layout; hand it to the step and take back the history."""
        assert self.directory is not None
        dcp.load(state, checkpoint_id=str(checkpoint.step_dir(self.directory, run["step"])))
        self.step_runner.load_state_dict(state)  # dcp.load wrote every tensor in place
        self.history = [self.stats(**stats) for stats in run["history"]]

    def save(self, count: int, step: int, state: dict, record: dict, **how: Any) -> None:
        """Collective: :func:`meshwise.train.checkpoint.save` of ``step`` (``how``: format, keep) on every
        rank, ``record`` and the history in run.json, then every rank learns whether that worked on all
        of them. A failure anywhere raises the same :class:`TrainingError` on every rank: one sentence
        ending in what is on disk instead. ``count`` (an epoch or step) is what the checkpoint keeps."""
        directory, world, error = self.directory, self.world, None
        assert directory is not None
        record = record | {"history": [asdict(stats) for stats in self.history]}
        path = Path(directory)
        try:
            path = checkpoint.save(
                directory, step, state, record, is_main=world.is_main, barrier=world.comm.barrier, **how
            )
        except (OSError, CheckpointException) as failure:
            exc: BaseException = failure
            if isinstance(exc, CheckpointException):  # DCP gathers every rank's error with its traceback
                exc = next((cause for cause, _trace in exc.failures.values()), exc)
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            error = f"cannot write the checkpoint in {directory} ({reason}); {self.left}"
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                error = f"no space left on device for the checkpoint in {directory}; {self.left}"
        if not self.everywhere(error is None):
            elsewhere = "another rank could not write its part of the checkpoint"
            raise TrainingError(error or f"{elsewhere}; {self.left}")
        self.checkpoint, self.kept = str(path), count
