"""One datagram socket that every worker's stdout and stderr write into: the kernel keeps write order.

Why not a pipe per stream: pipes carry no time stamps. When the launcher gets no CPU for a while
(an overloaded machine), lines that ranks wrote in turn pile up in two pipes and can only be read back
a pipe at a time, so rank 0's second line comes out before rank 1's first. Here a worker's file
descriptors 1 and 2 *are* sockets connected to one receiving socket: each ``write(2)`` becomes one
datagram appended to a single receive queue at the moment of the call, so the queue holds every
rank's writes in the order they happened. That holds at the descriptor level, for ``print``,
``sys.stdout.write``, ``os.write(1, ...)``, C extensions and any subprocess that inherits the
descriptors, which a Python-level wrapper of ``sys.stdout`` would not see.

Each sending socket is bound to its own name (``<channel>/<rank>/<stream>``), and ``recvfrom`` returns
that name with every datagram: a subprocess writing through an inherited descriptor is attributed to
its rank too.

Costs, measured in benchmarks/bench_run_output.py: the kernel queues at most ``net.unix.max_dgram_qlen``
datagrams (10 by default) before a writer blocks, so a rank printing as fast as it can waits for the
launcher more often than with a 64 KiB pipe; a single write larger than the socket send buffer fails
with EMSGSIZE instead of being split. That buffer is raised to 8 MiB where the launcher may
(CAP_NET_ADMIN) and otherwise to the kernel's ``net.core.wmem_max`` (416 KiB writes on a default kernel);
past about 4 MiB the kernel cannot allocate one datagram at all (ENOBUFS), whatever the buffer.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import sys
import tempfile
from pathlib import Path

#: requested send buffer; the kernel caps it at net.core.wmem_max (its doubled value is the largest
#: single write a worker can make).
_SEND_BUFFER = 8 << 20
_STREAMS = ("out", "err")
#: <asm-generic/socket.h>; Python's socket module does not export it
_LINUX_SO_SNDBUFFORCE = 32


class OutputChannel:
    """The receiving end (in the launcher) and the factory of each worker's two sending sockets."""

    def __init__(self) -> None:
        self._directory: tempfile.TemporaryDirectory[str] | None = None
        if sys.platform.startswith("linux"):
            # abstract names: nothing on disk to clean up, private to this network namespace
            self._base = f"\0meshwise-output-{os.getpid()}-{secrets.token_hex(8)}"
        else:
            self._directory = tempfile.TemporaryDirectory(prefix="meshwise-output-")
            self._base = self._directory.name
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(self._address("launcher"))
        self._socket.setblocking(False)
        self._names: dict[str, tuple[int, bool]] = {}
        self._buffer = bytearray(1 << 16)

    def _address(self, name: str) -> str:
        return f"{self._base}/{name}" if self._directory is None else str(Path(self._base) / name)

    def fileno(self) -> int:
        return self._socket.fileno()

    def senders(self, rank: int) -> tuple[socket.socket, socket.socket]:
        """Connected (stdout, stderr) sockets for ``rank``'s worker; the caller closes them once the
        worker has inherited them."""
        pair = []
        for stream in _STREAMS:
            name = f"{rank}.{stream}" if self._directory is not None else f"{rank}/{stream}"
            sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            _raise_send_buffer(sender)
            sender.bind(self._address(name))
            sender.connect(self._address("launcher"))
            self._names[_decoded(sender.getsockname())] = (rank, stream == "err")
            pair.append(sender)
        largest = max(s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) for s in pair)
        if len(self._buffer) < largest:
            self._buffer = bytearray(largest)  # a datagram longer than the buffer would be cut
        return pair[0], pair[1]

    def receive(self) -> list[tuple[int, bool, bytes]]:
        """Every datagram queued now, oldest first, as (rank, is stderr, bytes); [] when none."""
        received = []
        while True:
            try:
                size, sender = self._socket.recvfrom_into(self._buffer)
            except (BlockingIOError, InterruptedError):
                return received
            origin = self._names.get(_decoded(sender))
            if origin is not None:  # anything else was not sent by one of our workers
                received.append((*origin, bytes(memoryview(self._buffer)[:size])))

    def close(self) -> None:
        self._socket.close()
        if self._directory is not None:
            self._directory.cleanup()


def _raise_send_buffer(sender: socket.socket) -> None:
    """As large a send buffer as allowed: it bounds the largest single write a worker can make.

    SO_SNDBUF is capped at ``net.core.wmem_max`` (212,992 B on a default kernel, so 416 KiB writes);
    a launcher with CAP_NET_ADMIN (root, as on CI and in most containers) may pass that cap with
    SO_SNDBUFFORCE, so ``print`` of a multi-megabyte string still goes through as one datagram.
    """
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
    linux = sys.platform.startswith("linux")
    force = getattr(socket, "SO_SNDBUFFORCE", _LINUX_SO_SNDBUFFORCE if linux else None)
    if force is not None and sender.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < _SEND_BUFFER:
        with contextlib.suppress(PermissionError, OSError):
            sender.setsockopt(socket.SOL_SOCKET, force, _SEND_BUFFER)


def _decoded(address: str | bytes) -> str:
    """Socket names come back as bytes for abstract addresses and str for paths."""
    return address.decode(errors="surrogateescape") if isinstance(address, bytes) else address
