"""Epoch-numbered phases over the collective regions: the synchronisation all shm collectives share.

A *phase* is one round of "write into my region, publish, read what I need from peers' regions". Every
rank runs the same phases in the same order and counts them in its ``epoch`` word. Regions alternate by
epoch parity, which gives the whole protocol with one counter store and one wait per phase:

* before writing region ``e % 2`` for epoch ``e`` a rank waits until every peer reached ``e - 1``. Peers
  read that region for epoch ``e - 2`` before publishing ``e - 1``, so nobody still reads it;
* after writing it the rank issues a fence and stores ``epoch = e`` (x86-64 keeps stores in order);
* a reader waits for ``epoch >= e`` of just the peers it reads, then checks their signature word for
  ``e % 2`` (operation, dtype, sizes, root): a different value means ranks called different collectives.

A rank can therefore run at most one phase ahead of the slowest peer, which pipelines chunked messages.

A rank that has waited past its short spin sleeps on the awaited peer's epoch word (a futex) after
setting its ``sleeping`` word in that peer's segment; a rank that publishes an epoch wakes its
sleepers, paying the syscall only when one announced itself.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from meshwise.comm.api import CollectiveMismatchError
from meshwise.comm.shm.futex import futex_wait, futex_wake
from meshwise.comm.shm.kernels import Array, numpy_dtype
from meshwise.comm.shm.segment import Layout, Segment
from meshwise.comm.shm.sync import ABORT_MISMATCH, Waiter, store_fence


def signature(*parts: int) -> int:
    """A 64-bit fingerprint of a call; Python's hash of a tuple of ints is the same in every process."""
    return hash(parts)


class PhaseEngine:
    """Counters, regions and waits of one communicator's collective phases."""

    def __init__(self, rank: int, layout: Layout, segments: list[Segment], waiter: Waiter) -> None:
        self.rank = rank
        self.n = layout.world_size
        self.layout = layout
        self.waiter = waiter
        self.epoch = 0
        self._words: list[np.ndarray] = [s.words for s in segments]
        self._mine = self._words[rank]
        self._peers = [p for p in range(self.n) if p != rank]
        raw = [np.frombuffer(s.map, dtype=np.uint8) for s in segments]
        self._regions = [
            [b[layout.region_offset(q) : layout.region_offset(q) + layout.region_bytes] for q in (0, 1)]
            for b in raw
        ]
        self._typed: dict[tuple[int, int, torch.dtype], Array] = {}
        self._part_bytes = layout.region_bytes // self.n
        self._sig = 0
        #: views the collectives derive from the regions, kept per call shape (they never change)
        self.memo: dict[tuple, object] = {}
        #: called while waiting, so queued point-to-point messages keep moving during a collective
        self.progress: Callable[[], None] | None = None
        #: whether no point-to-point message is in flight: only then may a wait sleep (a queued message
        #: moves only while this rank polls)
        self.p2p_idle: Callable[[], bool] = lambda: True
        sleeping = layout.sleeping(0)
        self._sleepers = self._mine[sleeping : sleeping + self.n]
        self._epoch_address = [w.ctypes.data + 8 * layout.EPOCH for w in self._words]

    @property
    def peers(self) -> list[int]:
        return self._peers

    def view(self, owner: int, epoch: int, dtype: torch.dtype, count: int, part: int = 0) -> Array:
        """``count`` elements of ``dtype`` in ``owner``'s region for ``epoch``, sub-region ``part`` of n:
        a numpy array, or a torch tensor for a dtype numpy lacks (see :mod:`~meshwise.comm.shm.kernels`).

        The typed view of each region is made once and then only sliced: a collective takes 2n + 2 views
        per chunk, and on ranks that share cores this Python time is paid n/cores times over. Sub-regions
        are multiples of 64 bytes (:meth:`Layout.for_segment`), so every dtype's slice is exact."""
        key = (owner, epoch & 1, dtype)
        typed = self._typed.get(key)
        if typed is None:
            region = self._regions[owner][epoch & 1]
            as_numpy = numpy_dtype(dtype)
            typed = region.view(as_numpy) if as_numpy else torch.from_numpy(region).view(dtype)
            self._typed[key] = typed
        start = part * self._part_bytes // dtype.itemsize
        return typed[start : start + count]

    def capacity(self, dtype: torch.dtype, parts: int = 1) -> int:
        """Elements of ``dtype`` that fit in one region split into ``parts`` equal sub-regions.

        Each phase moves as much as the region holds: measured on 2 cores, a phase costs tens of
        microseconds of synchronisation, so 128 KiB phases ran 4x slower than 3 MiB ones.
        """
        return self.layout.region_bytes // parts // dtype.itemsize

    def begin(self, op: str) -> int:
        """Start the next phase: returns its epoch once this rank's region for it is free to write."""
        epoch = self.epoch + 1
        if epoch > 1:
            self._wait(epoch - 1, self._peers, op, check_sig=False)
        return epoch

    def post(self, epoch: int, sig: int, meta: list[int] | None = None) -> None:
        """Publish this rank's region for ``epoch`` (data must already be written)."""
        words, layout = self._mine, self.layout
        words[layout.sig(epoch & 1)] = sig
        if meta:
            start = layout.meta(epoch & 1)
            words[start : start + len(meta)] = meta
        store_fence()
        words[layout.EPOCH] = epoch
        self.epoch = epoch
        self._sig = sig
        store_fence()  # the epoch store before the read of the sleepers (the waiter fences the other way)
        if self._sleepers.any():
            futex_wake(self._epoch_address[self.rank])

    def wait(self, epoch: int, peers: list[int], op: str) -> None:
        """Block until ``peers`` published ``epoch``; raise if they published a different call."""
        self._wait(epoch, peers, op, check_sig=True)

    def meta(self, owner: int, epoch: int, count: int) -> list[int]:
        start = self.layout.meta(epoch & 1)
        return self._words[owner][start : start + count].tolist()

    def mismatch(self, message: str, op: str) -> CollectiveMismatchError:
        """Tell the peers (through the abort word) and build the error for this rank."""
        self._mine[self.layout.ABORT] = ABORT_MISMATCH
        return CollectiveMismatchError(message, rank=self.rank, op=op)

    def _wait(self, epoch: int, peers: list[int], op: str, *, check_sig: bool) -> None:
        index = self.layout.EPOCH
        words = [self._words[p] for p in peers]

        def ready() -> bool:
            return all(w[index] >= epoch for w in words)

        def pending() -> list[int]:
            return [p for p, w in zip(peers, words, strict=True) if w[index] < epoch]

        def sleep(seconds: float) -> None:
            late = pending()
            if late:
                self._sleep_on(late[0], epoch, seconds)

        if not ready():
            # with point-to-point messages in flight the wait must keep polling to move them
            sleeps = sleep if self.p2p_idle() else None
            self.waiter.wait(ready, op, peers, progress=self.progress, pending=pending, sleep=sleeps)
        if check_sig:
            slot = self.layout.sig(epoch & 1)
            for p, w in zip(peers, words, strict=True):
                if w[slot] != self._sig:
                    raise self.mismatch(
                        f"rank {p} called a different collective (or with other sizes, dtype or root) at "
                        f"call #{epoch}",
                        op,
                    )

    def _sleep_on(self, peer: int, epoch: int, seconds: float) -> None:
        """Sleep until ``peer`` publishes an epoch (or ``seconds`` pass) unless it reached ``epoch``.

        Announce first, then read the counter: a poster that stored its epoch before our announcement
        is seen here, one that stores it after sees the announcement and wakes us (full fences on both
        sides; the kernel re-checks the word atomically before sleeping)."""
        words, flag = self._words[peer], self.layout.sleeping(self.rank)
        words[flag] = 1
        store_fence()
        seen = int(words[self.layout.EPOCH])
        if seen < epoch:
            futex_wait(self._epoch_address[peer], seen, seconds)
        words[flag] = 0


class ThreadLimit:
    """Run the copies and reductions of a call on at most ``threads`` torch (OpenMP) threads.

    Ranks of one host share its cores. A rank whose copies fan out over every core makes its OpenMP
    workers spin for the peers' cores, exactly while the peers need them to publish: measured on 2 cores
    with 2 ranks of 2 threads each, a 1 MiB all_reduce took 47 ms instead of 0.3 ms. The previous setting
    is restored on exit, so the caller's own compute keeps its threads.
    """

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._previous = 0

    def __enter__(self) -> None:
        self._previous = torch.get_num_threads()
        if self._previous > self.threads:
            torch.set_num_threads(self.threads)

    def __exit__(self, *exc: object) -> None:
        if self._previous > self.threads:
            torch.set_num_threads(self._previous)
