"""Completion of MPI operations for the ``mpi`` backend: bounded waits and MPI errors as CommErrors.

An :class:`MpiWork` holds the MPI request of one non-blocking call, the NumPy views MPI still reads or
writes (so they outlive the call), and a ``finish`` step (copy-back of a float32 accumulator, AVG's
division, a size check) that runs exactly once, after the request completed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from meshwise.comm.api import CollectiveMismatchError, CommError, CommTimeoutError, Work
from meshwise.runtime.mpi_wait import all_done, import_mpi, wait_all


def translate_mpi_error(exc: Exception, rank: int, op: str) -> CommError:
    """An MPI error as the CommError subclass that explains it."""
    MPI = import_mpi()
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    error_class = exc.Get_error_class() if isinstance(exc, MPI.Exception) else None
    if error_class == MPI.ERR_TRUNCATE:
        return CollectiveMismatchError(
            f"a message was larger than the buffer posted for it ({text}): the ranks disagree on sizes",
            rank=rank,
            op=op,
        )
    return CommError(text, rank=rank, op=op)


#: requests abandoned before they completed, kept alive with their buffers for the life of the process.
_UNFINISHED: list[tuple[list[Any], Sequence[object]]] = []


class MpiWork(Work):
    """MPI requests polled under a deadline; ``finish`` (copy-back, AVG division) runs once after them."""

    def __init__(
        self,
        requests: Sequence[Any],
        rank: int,
        op: str,
        timeout: float,
        finish: Callable[[], None] | None = None,
        keep: Sequence[object] = (),
        statuses: list[Any] | None = None,
    ) -> None:
        self._requests = list(requests)
        self._statuses = statuses
        self._rank = rank
        self._op = op
        self._timeout = timeout
        self._finish = finish
        self._keep: Sequence[object] | None = keep  # buffers MPI still reads or writes

    def __del__(self) -> None:
        # A request dropped before completion (a timeout, or an async handle never waited on) may still
        # be written by MPI when a late peer arrives: its buffers must never be freed and reused.
        if self._keep is not None:
            _UNFINISHED.append((self._requests, self._keep))

    def _complete(self) -> None:
        self._requests = []
        self._keep = None
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()

    def wait(self, timeout: float | None = None) -> None:
        if self._keep is None:
            return
        limit = self._timeout if timeout is None else timeout
        try:
            done = wait_all(self._requests, limit, self._statuses)
        except Exception as exc:
            raise translate_mpi_error(exc, self._rank, self._op) from exc
        if not done:
            raise CommTimeoutError(
                f"no progress within {limit:g} s; a peer may have hung, died or called another operation "
                "(MPI cannot cancel it: end the job)",
                rank=self._rank,
                op=self._op,
            )
        self._complete()

    def is_completed(self) -> bool:
        if self._keep is None:
            return True
        try:
            done = all_done(self._requests, self._statuses)
        except Exception as exc:
            raise translate_mpi_error(exc, self._rank, self._op) from exc
        if done:
            self._complete()
        return done
