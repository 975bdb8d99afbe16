"""Forward every worker's output from one thread, in the order the ranks wrote it, a line at a time.

The order comes from :class:`~meshwise.runtime.output_channel.OutputChannel` (one kernel queue for all
ranks' writes). This thread only turns datagrams back into lines: a partial line (no newline yet) is
held per rank and stream until its newline arrives or the rank ends, so two ranks' halves of a line
never mix; bytes are decoded per *line*, so a UTF-8 character split over two writes survives and
invalid bytes become U+FFFD instead of an exception.

A line is printed as soon as the datagram that completes it is received: the loop blocks on the
channel, so a line reaches the terminal within a scheduling delay of being written.
"""

from __future__ import annotations

import contextlib
import queue
import select
import socket
import threading
from collections import deque
from collections.abc import Callable
from typing import IO

from meshwise.runtime.output_channel import OutputChannel

#: the loop wakes at least this often (to serve requests and a stop), seconds.
_WAKE_SECONDS = 0.05


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


class OutputPump:
    """The thread that forwards the lines of every rank's streams to a :class:`PrefixedOutput`."""

    def __init__(self, output: PrefixedOutput) -> None:
        self.output = output
        self.channel = OutputChannel()
        self._labels: dict[int, str] = {}
        self._tails: dict[int, deque[str]] = {}
        self._pending: dict[tuple[int, bool], bytearray] = {}
        self._requests: queue.Queue[Callable[[], None]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="meshwise-output", daemon=True)
        self._thread.start()

    def add(self, rank: int, label: str, tail: deque[str]) -> tuple[socket.socket, socket.socket]:
        """Register ``rank`` (its lines prefixed by ``label``, its stderr lines kept in ``tail``) and
        return the (stdout, stderr) sockets its worker must inherit; close them once it has started."""
        self._labels[rank], self._tails[rank] = label, tail
        return self.channel.senders(rank)

    def finish(self, rank: int, timeout: float) -> None:
        """Forward what ``rank`` wrote, including a last line without newline. Call it once the worker
        has exited: its writes are then all queued (a write is queued when it returns)."""
        done = threading.Event()

        def flush() -> None:
            self._receive()
            for stream in (False, True):
                self._flush((rank, stream))
            done.set()

        self._requests.put(flush)
        done.wait(timeout)

    def close(self, timeout: float) -> None:
        """Forward everything queued, flush partial lines, stop; give up after ``timeout`` seconds."""
        self._stop.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.channel.close()

    def _loop(self) -> None:
        """Only this thread reads the channel and touches the partial lines, so nothing races."""
        while not self._stop.is_set():
            with contextlib.suppress(InterruptedError):
                select.select([self.channel], [], [], _WAKE_SECONDS)
            self._receive()
            while not self._requests.empty():
                self._requests.get()()
        self._receive()
        for key in list(self._pending):
            self._flush(key)

    def _receive(self) -> None:
        """Forward every queued datagram. Consecutive lines for the same stream are written together (one
        write and flush instead of one per line: a flooding rank is paced by this loop)."""
        runs: list[tuple[bool, list[str]]] = []
        for rank, is_err, data in self.channel.receive():
            key = (rank, is_err)
            end = data.rfind(b"\n")
            if end < 0:
                self._pending.setdefault(key, bytearray()).extend(data)
                continue
            pending = self._pending.pop(key, None)
            complete = data[:end] if pending is None else bytes(pending + data[:end])
            if end + 1 < len(data):
                self._pending[key] = bytearray(data[end + 1 :])
            self._lines(rank, is_err, complete.split(b"\n"), runs)
        self._write(runs)

    def _flush(self, key: tuple[int, bool]) -> None:
        pending = self._pending.pop(key, None)
        if pending:
            runs: list[tuple[bool, list[str]]] = []
            self._lines(*key, [bytes(pending)], runs)
            self._write(runs)

    def _lines(
        self, rank: int, is_err: bool, raw_lines: list[bytes], runs: list[tuple[bool, list[str]]]
    ) -> None:
        """Decode, keep stderr's tail, and add the prefixed lines to ``runs`` (per stream, in order)."""
        lines = [raw.decode(errors="replace").rstrip("\r") for raw in raw_lines]
        if is_err:
            self._tails[rank].extend(lines)
        label = self._labels[rank]
        if not runs or runs[-1][0] != is_err:
            runs.append((is_err, []))
        runs[-1][1].extend(f"{label}{line}\n" for line in lines)

    def _write(self, runs: list[tuple[bool, list[str]]]) -> None:
        for is_err, texts in runs:
            self.output.write("".join(texts), to_err=is_err)
