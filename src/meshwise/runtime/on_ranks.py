"""Run a job's function on its ranks: those a launcher started, or ``-np`` local ones spawned here.

Every command that computes across ranks (``meshwise train``, ``pi``, ``bench``) makes the same
decision, so it is made here once: under a launcher (``meshwise run``, torchrun, srun, mpirun) this
process already is one rank and runs the function itself; otherwise a single rank runs in this process
and several are spawned, their failures propagated by :func:`~meshwise.runtime.spawn.spawn`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from meshwise.runtime.env import plan_ranks
from meshwise.runtime.spawn import spawn

T = TypeVar("T")


def run_on_ranks(
    fn: Callable[..., T], args: tuple, *, nproc: int | None, default: int, deadline: float
) -> T | None:
    """``fn(*args)`` on every rank; rank 0's result here, None on the other ranks of a launched job,
    unless their result is an exception: a failure every rank returns must end every rank non-zero.

    ``nproc`` is the command's ``-np`` (it must agree with a launcher's layout; ``default`` ranks when
    omitted and unlaunched), and ``deadline`` bounds the spawned ranks' whole run in seconds.
    """
    plan = plan_ranks(nproc, default=default)
    if plan.launched:
        result = fn(*args)
        return result if plan.layout.rank == 0 or isinstance(result, Exception) else None
    if plan.world_size == 1:
        return fn(*args)
    return spawn(fn, plan.world_size, args, timeout=deadline)[0]
