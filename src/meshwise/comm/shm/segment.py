"""Shared-memory segments: naming, sizing against /dev/shm, the memory-model check and the layout.

Each rank owns one file in ``/dev/shm`` (tmpfs) that it maps once and reuses for every call. The file is
named ``meshwise-<job token>-r<rank>`` with a token drawn by rank 0, so two jobs on one host never
collide, and it is unlinked as soon as every rank has mapped it: from then on the kernel frees the memory
when the last process exits, even after ``kill -9``. Space is reserved with ``posix_fallocate`` so a full
tmpfs is an error at start-up instead of a SIGBUS in the middle of a collective.

Layout of one segment (all offsets 64-byte aligned; every counter has a cache line of its own, so a
rank spinning on a peer's counter does not falsely share a line with data being written)::

    header  | epoch | abort | sig[2] | meta[2][n] | sent[n] | recvd[n] | sleeping[n] | p2p headers[n][2] |
    region 0 (collectives, even epochs) | region 1 (odd epochs) | p2p slots [n peers][2] |
"""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import sys
from dataclasses import dataclass

import numpy as np

from meshwise.comm.api import CommError

LINE_WORDS = 8  # int64 words per 64-byte cache line
ALIGN = 64
MIN_REGION_BYTES = 64 * 1024
DEFAULT_SEGMENT_BYTES = 8 * 2**20
NAME_PREFIX = "meshwise-"

#: machines whose memory model we rely on: x86-64 is TSO (stores are seen in program order, loads are not
#: reordered with other loads), so "write data, fence, write counter" / "read counter, read data" is safe.
SUPPORTED_MACHINES = ("x86_64", "amd64")


class ShmSpaceError(CommError):
    """/dev/shm cannot hold even the smallest segments this job needs."""


def check_memory_model(machine: str | None = None, system: str | None = None) -> None:
    """Refuse to run on CPUs whose memory ordering this transport has not been validated for (and off
    Linux, whose tmpfs, ``posix_fallocate`` and ``/proc`` it relies on)."""
    machine = (machine or platform.machine()).lower()
    system = system or sys.platform
    if not system.startswith("linux"):
        raise CommError(
            f"the shm backend needs Linux (/dev/shm, /proc), not {system!r}: use backend='gloo'",
            op="shm init",
        )
    if machine not in SUPPORTED_MACHINES:
        raise CommError(
            f"the shm backend relies on x86-64 (TSO) store ordering and is not validated on {machine!r}: "
            "use backend='gloo' on this machine",
            op="shm init",
        )


def _round_down(value: int, multiple: int) -> int:
    return value // multiple * multiple


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Layout:
    """Byte and word offsets inside every rank's segment (identical on all ranks of a communicator)."""

    world_size: int
    region_bytes: int  # one collective region; there are two (even/odd epochs)
    p2p_bytes: int  # one point-to-point slot; two per peer

    @classmethod
    def for_segment(cls, world_size: int, segment_bytes: int) -> Layout:
        """Split a data budget of ``segment_bytes``: 3/4 for the two collective regions, 1/4 for p2p."""
        unit = ALIGN * world_size  # so each of the n sub-regions is cache-line aligned
        region = max(_round_up(MIN_REGION_BYTES // 2, unit), _round_down(segment_bytes * 3 // 8, unit))
        peers = max(1, world_size - 1)
        p2p = max(4096, _round_down(segment_bytes // (8 * peers), ALIGN))
        return cls(world_size, region, p2p)

    # word offsets into the int64 header
    EPOCH = 0
    ABORT = LINE_WORDS

    def sig(self, parity: int) -> int:
        return (2 + parity) * LINE_WORDS

    def meta(self, parity: int) -> int:
        return 4 * LINE_WORDS + parity * self._meta_words

    @property
    def _meta_words(self) -> int:
        """Room for two counts per rank: all_to_all posts what it sends to and expects from each rank."""
        return _round_up(2 * self.world_size, LINE_WORDS)

    def sent(self, peer: int) -> int:
        return 4 * LINE_WORDS + 2 * self._meta_words + peer * LINE_WORDS

    def recvd(self, peer: int) -> int:
        return self.sent(self.world_size) + peer * LINE_WORDS

    def sleeping(self, waiter: int) -> int:
        """Set by rank ``waiter`` in the segment of the rank whose epoch it sleeps on (the words of all
        waiters are adjacent, so a publishing rank reads them in one slice; see phase.py)."""
        return self.recvd(self.world_size) + waiter

    def p2p_header(self, peer: int, slot: int) -> int:
        return self.sleeping(0) + _round_up(self.world_size, LINE_WORDS) + (2 * peer + slot) * LINE_WORDS

    @property
    def header_words(self) -> int:
        return self.p2p_header(self.world_size, 0)

    @property
    def header_bytes(self) -> int:
        return _round_up(self.header_words * 8, 4096)

    def region_offset(self, parity: int) -> int:
        return self.header_bytes + parity * self.region_bytes

    def p2p_offset(self, peer: int, slot: int) -> int:
        return self.header_bytes + 2 * self.region_bytes + (2 * peer + slot) * self.p2p_bytes

    @property
    def total_bytes(self) -> int:
        return self.p2p_offset(self.world_size, 0)


def free_bytes(shm_dir: str) -> int:
    """Bytes an unprivileged process may still allocate in ``shm_dir``."""
    stat = os.statvfs(shm_dir)
    return stat.f_bavail * stat.f_frsize


def plan_layout(world_size: int, segment_bytes: int, available: int) -> tuple[Layout, str | None]:
    """The largest layout up to ``segment_bytes`` whose ``world_size`` segments fit in ``available`` bytes.

    Returns the layout and a warning when it had to shrink (smaller chunks: correct, somewhat slower);
    raises :class:`ShmSpaceError` when even the smallest chunks do not fit.
    """
    if segment_bytes < MIN_REGION_BYTES:
        raise ValueError(f"segment_bytes must be at least {MIN_REGION_BYTES} (64 KiB), got {segment_bytes}")
    wanted = Layout.for_segment(world_size, segment_bytes)
    need = world_size * wanted.total_bytes
    budget = segment_bytes
    layout = wanted
    while world_size * layout.total_bytes > available and budget > MIN_REGION_BYTES:
        budget = max(MIN_REGION_BYTES, budget // 2)
        layout = Layout.for_segment(world_size, budget)
    if world_size * layout.total_bytes > available:
        smallest = world_size * layout.total_bytes
        raise ShmSpaceError(
            f"/dev/shm has {available / 2**20:.1f} MiB free but {world_size} ranks need at least "
            f"{smallest / 2**20:.1f} MiB ({need / 2**20:.1f} MiB for full speed): enlarge it, e.g. "
            f"`docker run --shm-size={max(64, 2 * need // 2**20)}m ...` (or mount -o remount,size=... "
            "/dev/shm), free space there, or use backend='gloo'",
            op="shm init",
        )
    if layout is wanted:
        return layout, None
    return layout, (
        f"/dev/shm has only {available / 2**20:.1f} MiB free, so shm segments shrank from "
        f"{need / 2**20:.1f} MiB to {world_size * layout.total_bytes / 2**20:.1f} MiB in total (smaller "
        f"chunks, lower bandwidth); give containers more, e.g. `docker run --shm-size={2 * need // 2**20}m`"
    )


def segment_path(shm_dir: str, token: str, rank: int) -> str:
    return os.path.join(shm_dir, f"{NAME_PREFIX}{token}-r{rank}")


class Segment:
    """One mapped segment: the int64 header as numpy and the whole mapping as a writable buffer."""

    def __init__(self, path: str, layout: Layout, *, create: bool) -> None:
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                try:
                    os.posix_fallocate(fd, 0, layout.total_bytes)
                except OSError as exc:
                    os.unlink(path)
                    raise ShmSpaceError(
                        f"cannot reserve {layout.total_bytes / 2**20:.1f} MiB in {os.path.dirname(path)} "
                        f"({exc.strerror}); enlarge /dev/shm (`docker run --shm-size=...`) or use gloo",
                        op="shm init",
                    ) from exc
            elif os.fstat(fd).st_size < layout.total_bytes:
                raise CommError(f"segment {path} is smaller than the agreed layout", op="shm init")
            self.map = mmap.mmap(fd, layout.total_bytes)
        finally:
            os.close(fd)
        self.words = np.frombuffer(self.map, dtype=np.int64, count=layout.header_words)

    def close(self) -> None:
        """Drop this process's mapping (views still alive elsewhere keep it until they go)."""
        self.words = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):  # a torch view still exports it; it goes with the view
            self.map.close()


def unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
