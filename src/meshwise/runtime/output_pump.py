"""Forward every worker's stdout and stderr from one thread, a rank's lines in the order it wrote them.

Why one thread for all ranks rather than one per stream: with a thread per pipe, each line waits for its
own thread to be scheduled, so on a busy machine a line rank 0 printed *before* a barrier could reach
the terminal after the line rank 1 printed once the barrier was passed (seen in 2 of 5 runs of a
two-rank script). Here one loop waits on every pipe at once and reads them in the order they became
readable (see :class:`_Poller`): a line written before a barrier is in its pipe before any rank leaves
the barrier, so it is read no later than the lines written after it. (What pipes cannot tell is the
order of several lines that pile up in two pipes while the loop is not scheduled at all; those come out
a pipe at a time.)

Lines are the unit: a partial line (no newline yet) is held until its newline arrives or the stream
ends, so two ranks' halves of a line never mix.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import IO

#: the loop wakes at least this often (to notice new streams and a stop request), seconds.
_WAKE_SECONDS = 0.05
_READ_BYTES = 1 << 16


class PrefixedOutput:
    """Serialised writes to the launcher's streams, flushed at once; a closed stream is tolerated."""

    def __init__(self, out: IO[str], err: IO[str]) -> None:
        self.out, self.err = out, err
        self.lock = threading.Lock()

    def write(self, text: str, *, to_err: bool) -> None:
        with self.lock, contextlib.suppress(OSError, ValueError):  # reader gone: keep draining anyway
            sink = self.err if to_err else self.out
            sink.write(text)
            sink.flush()


@dataclass
class Stream:
    """One worker pipe: where its lines go and what is kept of them."""

    pipe: IO[bytes]
    rank: int
    label: str
    is_err: bool
    tail: deque[str] | None = None  # keeps the last lines (a failure report shows stderr's)
    closed: threading.Event = field(default_factory=threading.Event)
    pending: bytearray = field(default_factory=bytearray)


class OutputPump:
    """The thread that forwards the lines of every added :class:`Stream` to a :class:`PrefixedOutput`."""

    def __init__(self, output: PrefixedOutput) -> None:
        self.output = output
        self._streams: dict[int, Stream] = {}  # by file descriptor
        self._poller = _Poller()
        self._stop = threading.Event()  # finish once every stream has ended
        self._abandon = threading.Event()  # finish now
        self._thread = threading.Thread(target=self._loop, name="meshwise-output", daemon=True)
        self._thread.start()

    def add(self, stream: Stream) -> None:
        fd = stream.pipe.fileno()
        os.set_blocking(fd, False)
        self._streams[fd] = stream
        self._poller.register(fd)

    def close(self, timeout: float) -> None:
        """Stop once the open streams are drained, or after ``timeout`` seconds (a grandchild may keep
        a pipe open forever): then what is left unread is dropped."""
        self._stop.set()
        self._thread.join(timeout)
        self._abandon.set()
        self._thread.join()

    def _loop(self) -> None:
        """Only this thread reads, unregisters and closes, so nothing races with it."""
        while not self._abandon.is_set() and not (self._stop.is_set() and not self._streams):
            if not self._streams:
                self._stop.wait(_WAKE_SECONDS)
                continue
            for fd in self._poller.ready(_WAKE_SECONDS):  # in the order the pipes became readable
                self._read(self._streams[fd])
        for stream in list(self._streams.values()):
            self._finish(stream)
        self._poller.close()

    def _read(self, stream: Stream) -> None:
        """Everything the pipe holds now (edge-triggered: no second notice for data left behind)."""
        fd = stream.pipe.fileno()
        while True:
            try:
                data = os.read(fd, _READ_BYTES)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                self._finish(stream)
                return
            stream.pending += data
        complete, newline, rest = bytes(stream.pending).rpartition(b"\n")
        if newline:
            stream.pending = bytearray(rest)
            self._emit(stream, complete.split(b"\n"))

    def _emit(self, stream: Stream, raw_lines: list[bytes]) -> None:
        lines = [raw.decode(errors="replace").rstrip("\r") for raw in raw_lines]
        if stream.tail is not None:
            stream.tail.extend(lines)
        self.output.write("".join(f"{stream.label}{line}\n" for line in lines), to_err=stream.is_err)

    def _finish(self, stream: Stream) -> None:
        """End of a stream: forward a last line without newline, stop watching, release the pipe."""
        if stream.closed.is_set():
            return
        if stream.pending:
            self._emit(stream, [bytes(stream.pending)])
            stream.pending.clear()
        fd = stream.pipe.fileno()
        self._poller.unregister(fd)
        del self._streams[fd]
        stream.pipe.close()
        stream.closed.set()


class _Poller:
    """Readiness of pipes in the order they became readable.

    epoll in edge-triggered mode queues a pipe when data arrives into an empty one and reports the
    queue in that order, which is what keeps lines of ranks that take turns in turn (level-triggered
    epoll re-queues a pipe it has reported, at the tail, so a later write could be reported first).
    Without epoll, ``poll`` reports in descriptor order.
    """

    def __init__(self) -> None:
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        self._poll = None if self._epoll is not None else select.poll()

    def register(self, fd: int) -> None:
        if self._epoll is not None:
            self._epoll.register(fd, select.EPOLLIN | select.EPOLLET)
        else:
            self._poll.register(fd, select.POLLIN)

    def unregister(self, fd: int) -> None:
        with contextlib.suppress(KeyError, OSError, ValueError):
            (self._epoll or self._poll).unregister(fd)

    def ready(self, timeout: float) -> list[int]:
        if self._epoll is not None:
            return [fd for fd, _ in self._epoll.poll(timeout)]
        return [fd for fd, _ in self._poll.poll(timeout * 1000)]

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()
