"""A Communicator that records every operation (flight recorder) and, in debug mode, checks collectives.

``meshwise.init()`` wraps the data-plane communicator in one of these, so the rest of the library (DDP,
benchmarks, user scripts) is instrumented without knowing it. The base class has already validated and
normalised the arguments; each primitive here numbers the collective, fingerprints it, records it,
checks it across ranks when a :class:`~meshwise.comm.debug.DebugChecker` is given, and only then hands
it to the wrapped backend. Any :class:`CommError` — raised at issue or at ``wait`` — marks the record
failed and dumps the process's recorders before it propagates.

The user's collectives are numbered from 1: collectives meshwise issues while setting itself up (the
mesh's splits in ``meshwise.init``, inside :meth:`InstrumentedCommunicator.setup`) are numbered, recorded
and checked apart, as the group ``<group>/setup``, so the flight recorder, the hang report and debug
mode all call the user's first collective #1. A split into one rank involves no peer and is not numbered.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from meshwise.comm import flight_recorder
from meshwise.comm.api import Collective, CommError, Communicator, CompletedWork, ReduceOp, Work
from meshwise.comm.debug import DebugChecker
from meshwise.comm.fingerprint import Fingerprint
from meshwise.comm.flight_recorder import FlightRecorder, OpRecord


class RecordedWork(Work):
    """The wrapped backend's work; its completion or failure is written into the record."""

    def __init__(self, inner: Work, record: OpRecord) -> None:
        self._inner, self._record = inner, record

    def wait(self, timeout: float | None = None) -> None:
        began = time.time()
        try:
            self._inner.wait(timeout)
        except CommError as exc:
            _failed(self._record, exc)
            raise
        if self._record.state == "started":
            FlightRecorder.complete(self._record)
            self._record.waited = self._record.ended - began  # type: ignore[operator]

    def is_completed(self) -> bool:
        return self._inner.is_completed()


def _failed(record: OpRecord, exc: CommError) -> None:
    FlightRecorder.fail(record, exc)
    flight_recorder.dump(f"{type(exc).__name__}: {exc}")


@dataclass
class _Numbering:
    """One sequence of collective numbers, with the recorder and checker that see it."""

    recorder: FlightRecorder
    checker: DebugChecker | None
    seq: int = 0


class InstrumentedCommunicator(Communicator):
    """``inner`` with a flight recorder (``capacity`` operations) and an optional cross-rank check."""

    def __init__(
        self,
        inner: Communicator,
        *,
        group: str = "world",
        capacity: int = flight_recorder.DEFAULT_CAPACITY,
        checker: DebugChecker | None = None,
    ) -> None:
        super().__init__(inner.rank, inner.world_size, inner.timeout)
        self.inner, self.checker = inner, checker
        self.backend = inner.backend
        self.overlaps_compute = inner.overlaps_compute
        self.recorder = FlightRecorder(group, inner.rank, inner.world_size, capacity)
        self._algorithm: str | None = getattr(inner, "algo", None)
        self._user = self._numbering = _Numbering(self.recorder, checker)
        self._setup: _Numbering | None = None
        self._splits = 0
        self._lock = threading.Lock()  # DDP hooks may issue collectives from autograd threads

    @property
    def debug(self) -> bool:
        return self.checker is not None

    def __getattr__(self, name: str):  # backend extras (e.g. ``group``) stay reachable
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        """Number the operations issued inside apart from the user's (``meshwise.init`` builds its mesh
        here): all ranks enter it around the same calls, so the numbers still agree across ranks."""
        if self._setup is None:
            capacity = self.recorder.records.maxlen or 1
            recorder = FlightRecorder(f"{self.recorder.group}/setup", self.rank, self.world_size, capacity)
            child = None if self.checker is None else self.checker.child("setup", self.rank, self.world_size)
            self._setup = _Numbering(recorder, child)
        self._numbering = self._setup
        try:
            yield
        finally:
            self._numbering = self._user

    # ------------------------------------------------------------------ the one path every op takes
    def _run(
        self, make: Callable[[int], Fingerprint], issue: Callable[[], Work], *, check: bool = True
    ) -> Work:
        """Number (collectives only), record, check in debug mode, issue. Collectives are numbered and
        issued under a lock so that their numbers follow the order the backend sees; point-to-point
        operations are not numbered and never wait for it."""
        numbering = self._numbering
        if not check:
            return self._issue(make(0), issue, numbering.recorder, None)
        with self._lock:
            numbering.seq += 1
            return self._issue(make(numbering.seq), issue, numbering.recorder, numbering.checker)

    @staticmethod
    def _issue(
        fp: Fingerprint, issue: Callable[[], Work], recorder: FlightRecorder, checker: DebugChecker | None
    ) -> Work:
        record = recorder.start(fp)
        try:
            if checker is not None:
                checker.check(fp)
            work = issue()
        except CommError as exc:
            _failed(record, exc)
            raise
        record.issued = time.time()
        return RecordedWork(work, record)

    def _algo(self) -> str | None:
        return self._algorithm

    # ------------------------------------------------------------------ point to point (recorded only)
    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        return self._run(
            lambda s: Fingerprint.of(s, "send", tensor, root=dst),
            lambda: self.inner._isend(tensor, dst, tag),
            check=False,
        )

    def _irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        return self._run(
            lambda s: Fingerprint.of(s, "recv", tensor, root=src),
            lambda: self.inner._irecv(tensor, src, tag),
            check=False,
        )

    # ------------------------------------------------------------------ collectives
    def _broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        return self._run(
            lambda s: Fingerprint.of(s, Collective.BROADCAST, tensor, root=root, algorithm=self._algo()),
            lambda: self.inner._broadcast(tensor, root),
        )

    def _reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp) -> Work:
        return self._run(
            lambda s: Fingerprint.of(
                s, Collective.REDUCE, tensor, root=root, reduce_op=op.value, algorithm=self._algo()
            ),
            lambda: self.inner._reduce(tensor, root, op),
        )

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        return self._run(
            lambda s: Fingerprint.of(
                s, Collective.ALL_REDUCE, tensor, reduce_op=op.value, algorithm=self._algo()
            ),
            lambda: self.inner._all_reduce(tensor, op),
        )

    def _all_reduce_into(self, source: torch.Tensor, output: torch.Tensor, op: ReduceOp) -> Work:
        return self._run(
            lambda s: Fingerprint.of(
                s, Collective.ALL_REDUCE, source, reduce_op=op.value, algorithm=self._algo()
            ),
            lambda: self.inner._all_reduce_into(source, output, op),
        )

    def _all_gather(self, outputs: list[torch.Tensor], input: torch.Tensor) -> Work:
        return self._run(
            lambda s: Fingerprint.of(
                s, Collective.ALL_GATHER, input, slots_out=outputs, algorithm=self._algo()
            ),
            lambda: self.inner._all_gather(outputs, input),
        )

    def _reduce_scatter(self, output: torch.Tensor, inputs: list[torch.Tensor], op: ReduceOp) -> Work:
        return self._run(
            lambda s: Fingerprint.of(
                s,
                Collective.REDUCE_SCATTER,
                output,
                slots_in=inputs,
                reduce_op=op.value,
                algorithm=self._algo(),
            ),
            lambda: self.inner._reduce_scatter(output, inputs, op),
        )

    def _all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Work:
        return self._run(
            lambda s: Fingerprint.of(
                s, Collective.ALL_TO_ALL, slots_in=inputs, slots_out=outputs, algorithm=self._algo()
            ),
            lambda: self.inner._all_to_all(outputs, inputs),
        )

    def _scatter(self, output: torch.Tensor, inputs: list[torch.Tensor] | None, root: int) -> Work:
        return self._run(
            lambda s: Fingerprint.of(
                s, Collective.SCATTER, output, slots_in=inputs, root=root, algorithm=self._algo()
            ),
            lambda: self.inner._scatter(output, inputs, root),
        )

    def _gather(self, input: torch.Tensor, outputs: list[torch.Tensor] | None, root: int) -> Work:
        return self._run(
            lambda s: Fingerprint.of(
                s, Collective.GATHER, input, slots_out=outputs, root=root, algorithm=self._algo()
            ),
            lambda: self.inner._gather(input, outputs, root),
        )

    def _barrier(self) -> Work:
        return self._run(lambda s: Fingerprint.of(s, "barrier"), self.inner._barrier)

    def _split(self, ranks: list[int]) -> Communicator | None:
        inner: list[Communicator | None] = []

        def issue() -> Work:
            inner.append(self.inner._split(ranks))
            return CompletedWork()

        if len(ranks) == 1:  # made by its member alone: no peer to number or check it with
            self._run(lambda s: Fingerprint.of(s, "split", ranks=ranks), issue, check=False).wait()
            child, name = inner[0], f"{self.recorder.group}/self"
        else:
            self._run(lambda s: Fingerprint.of(s, "split", ranks=ranks), issue).wait()
            self._splits += 1  # the same count on every rank: every rank takes part in each such split
            child, name = inner[0], f"{self.recorder.group}/split{self._splits}"
        if child is None:
            return None
        checker = None if self.checker is None else self.checker.child(name, child.rank, child.world_size)
        return InstrumentedCommunicator(
            child, group=name, capacity=self.recorder.records.maxlen or 1, checker=checker
        )

    def close(self) -> None:
        """Close the backend; in debug mode first check that every rank is closing too (a rank that
        skipped a collective, or called an extra one, meets ``close`` here and is reported)."""
        try:
            if self.checker is not None and not self.checker.broken:
                self._run(lambda s: Fingerprint.of(s, "close"), CompletedWork).wait()
        finally:
            self.inner.close()
