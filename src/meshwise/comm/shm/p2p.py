"""Point-to-point messages over shared memory: a two-slot mailbox per ordered pair of ranks.

The sender owns the mailbox in its segment (``p2p slots[dst][2]``) and counts posted chunks in
``sent[dst]``; the receiver counts consumed chunks in its own ``recvd[src]``. Chunk ``k`` goes to slot
``k % 2`` once the receiver has consumed chunk ``k - 2``, so a message of any size streams through a
bounded buffer while sender and receiver overlap. Messages between a pair are delivered in the order
they were posted (as in MPI); the first chunk carries the tag and total size, and a receive whose tag or
size differs raises :class:`CollectiveMismatchError` instead of silently mixing messages.

Operations progress whenever any wait on this communicator spins, so ``irecv``; ``isend``; ``wait`` on
every rank of a ring cannot deadlock.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch

from meshwise.comm.api import Work
from meshwise.comm.numpy_view import numpy_view
from meshwise.comm.shm.phase import PhaseEngine, ThreadLimit
from meshwise.comm.shm.segment import Layout, Segment
from meshwise.comm.shm.sync import Waiter, store_fence


class _Message:
    def __init__(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self.data = _bytes_of(tensor)
        self.peer = peer
        self.tag = tag
        self.offset = 0
        self.done = False


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's memory as a flat numpy byte array (the caller checked it is contiguous).

    numpy rather than torch views: a numpy slice or copy costs ~1 µs where each torch call costs 5–30 µs
    on a busy CPU, and a pipeline stage's neighbour waits through every call of a send and a receive."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    try:
        array = numpy_view(tensor)
    except TypeError:  # a dtype numpy lacks (bfloat16, float8): its bytes
        array = numpy_view(tensor.view(torch.uint8))
    return array.reshape(-1).view(np.uint8)


class P2PWork(Work):
    """Handle of one isend/irecv; waiting drives every pending message of the communicator."""

    def __init__(self, engine: P2PEngine, message: _Message, op: str) -> None:
        self._engine = engine
        self._message = message
        self._op = op

    def wait(self, timeout: float | None = None) -> None:
        message = self._message
        self._engine.progress()
        if not message.done:
            self._engine.waiter.wait(
                lambda: message.done,
                self._op,
                [message.peer],
                progress=self._engine.progress,
                timeout=timeout,
            )

    def is_completed(self) -> bool:
        if not self._message.done:
            self._engine.progress()
        return self._message.done


class P2PEngine:
    """Mailboxes of one communicator and the queues of messages still in flight."""

    def __init__(
        self, rank: int, layout: Layout, segments: list[Segment], phases: PhaseEngine, threads: ThreadLimit
    ) -> None:
        self._threads = threads
        self.rank = rank
        self.layout = layout
        self.waiter: Waiter = phases.waiter
        self._words: list[np.ndarray] = [s.words for s in segments]
        raw = [np.frombuffer(s.map, dtype=np.uint8) for s in segments]
        size = layout.p2p_bytes
        # slots[owner][peer][k]: owner's mailbox towards peer
        self._slots = [
            [
                [b[layout.p2p_offset(p, k) : layout.p2p_offset(p, k) + size] for k in (0, 1)]
                for p in range(len(raw))
            ]
            for b in raw
        ]
        self._sends: dict[int, deque[_Message]] = {}
        self._recvs: dict[int, deque[_Message]] = {}
        self._sent = [0] * layout.world_size
        self._recvd = [0] * layout.world_size
        self._pending = 0
        self._phases = phases

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        message = _Message(tensor, dst, tag)
        self._sends.setdefault(dst, deque()).append(message)
        self._pending += 1
        self.progress()
        return P2PWork(self, message, "send")

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        message = _Message(tensor, src, tag)
        self._recvs.setdefault(src, deque()).append(message)
        self._pending += 1
        self.progress()
        return P2PWork(self, message, "recv")

    @property
    def idle(self) -> bool:
        return self._pending == 0

    def progress(self) -> None:
        """Move every queued message forward as far as it can go without waiting."""
        if self._pending == 0:
            return
        with self._threads:
            for dst, queue in self._sends.items():
                while queue and self._push(dst, queue[0]):
                    queue.popleft().done = True
                    self._pending -= 1
            for src, queue in self._recvs.items():
                while queue and self._pull(src, queue[0]):
                    queue.popleft().done = True
                    self._pending -= 1

    def _push(self, dst: int, message: _Message) -> bool:
        """Post chunks while mailbox slots are free; True once the whole message is posted."""
        layout, mine = self.layout, self._words[self.rank]
        total = message.data.size
        while True:
            chunk = self._sent[dst] + 1
            if self._words[dst][layout.recvd(self.rank)] < chunk - 2:
                return False
            count = min(layout.p2p_bytes, total - message.offset)
            slot = chunk & 1
            if count:
                piece = message.data[message.offset : message.offset + count]
                self._slots[self.rank][dst][slot][:count] = piece
            header = layout.p2p_header(dst, slot)
            mine[header : header + 3] = (message.tag, total, count)
            store_fence()
            mine[layout.sent(dst)] = chunk
            self._sent[dst] = chunk
            message.offset += count
            if message.offset >= total:
                return True

    def _pull(self, src: int, message: _Message) -> bool:
        """Consume chunks that arrived; True once the whole message is received."""
        layout, theirs = self.layout, self._words[src]
        total = message.data.size
        while True:
            chunk = self._recvd[src] + 1
            if theirs[layout.sent(self.rank)] < chunk:
                return False
            slot = chunk & 1
            header = layout.p2p_header(self.rank, slot)
            tag, size, count = (int(v) for v in theirs[header : header + 3])
            if message.offset == 0 and (tag != message.tag or size != total):
                self._pending = 0
                raise self._phases.mismatch(
                    f"message from rank {src} has tag {tag} and {size} bytes but this receive expects tag "
                    f"{message.tag} and {total} bytes (messages between a pair arrive in posting order)",
                    "recv",
                )
            if count:
                piece = self._slots[src][self.rank][slot][:count]
                message.data[message.offset : message.offset + count] = piece
            self._words[self.rank][layout.recvd(src)] = chunk
            self._recvd[src] = chunk
            message.offset += count
            if message.offset >= total:
                return True
