"""The one error type a training run stops with — a sentence for the user and the exit code it deserves —
and the way it travels from the ranks (:func:`train_on_rank`) to whoever started the job (:func:`launch`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

from meshwise.runtime.deadline import job_deadline
from meshwise.runtime.on_ranks import run_on_ranks
from meshwise.train.sections import MeshSection
from meshwise.world import World, init, shutdown

Result = TypeVar("Result")
Run = TypeVar("Run")


class TrainingError(Exception):
    """A run that cannot go on (diverged, checkpoint unwritable or unusable), said in one line.

    ``exit_code`` is 2 when the user's input is at fault (a checkpoint of other data, an unwritable
    directory) and 1 otherwise. Ranks return it rather than raise it, so the job that started them can
    print rank 0's sentence instead of a traceback; ``__reduce__`` keeps the code across the pipe.
    Every rank reaches the same error together (it is decided on reduced values), so ``rank`` says
    which rank holds this copy: under a launcher only rank 0 prints it, the others exit with its code.
    """

    def __init__(self, message: str, exit_code: int = 1, rank: int = 0) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.rank = rank

    def __reduce__(self) -> tuple[type, tuple[str, int, int]]:
        return type(self), (str(self), self.exit_code, self.rank)


def diverged_on(first_steps: list[int]) -> tuple[int, str]:
    """(first step, where) from each rank's first step with a non-finite loss (0: none).

    ``where`` names the ranks whose loss went first, as " on rank 1" or " on ranks 0, 2", or "" when it
    is every rank or a single-rank run (after one step all ranks share the non-finite weights, so the
    first ranks are where to look). (0, "") when no rank saw one.
    """
    seen = [step for step in first_steps if step > 0]
    if not seen:
        return 0, ""
    first = min(seen)
    ranks = [rank for rank, step in enumerate(first_steps) if step == first]
    if len(ranks) == len(first_steps):
        return first, ""
    return first, f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def train_on_rank(
    section: MeshSection, train: Callable[[World], Result], **init_args: Any
) -> Result | TrainingError | None:
    """Join the job as ``section`` says (``init_args``: more of :func:`~meshwise.world.init`'s), run this
    rank's ``train(world)`` and leave: rank 0 returns the result (the others None), and a
    :class:`TrainingError` comes back as a value marked with this rank, so the caller prints one
    sentence, not a traceback (``meshwise train`` and ``train gpt`` alike)."""
    world = init(section.backend, device=section.device, timeout=section.comm_timeout, **init_args)
    try:
        result = train(world)
    except TrainingError as exc:
        exc.rank = world.rank
        return exc
    finally:
        shutdown()
    return result if world.is_main else None


def launch(
    rank_main: Callable[[Run], Result | TrainingError | None], run: Run, mesh: MeshSection
) -> Result | None:
    """Train ``run`` with ``rank_main`` on the ranks a launcher started, or on ``-np`` local ranks spawned
    here (either trainer alike); return rank 0's result (None on the other launched ranks).

    Raises the :class:`TrainingError` when the run had to stop (every rank returns it; rank 0's copy says
    the most).
    """
    with job_deadline(mesh.timeout):  # the spawned ranks have none of their own: see job_deadline
        outcome = run_on_ranks(rank_main, (run,), nproc=mesh.nproc, default=1, deadline=math.inf)
    if isinstance(outcome, TrainingError):
        raise outcome
    return outcome
