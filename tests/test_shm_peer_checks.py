"""Dead/closed-peer detection in the shm waits must never blame a peer that already did its part."""

import os

import pytest
import torch

import meshwise
from meshwise.comm.api import PeerFailureError
from meshwise.comm.shm import ShmCommunicator
from meshwise.comm.shm.sync import ABORT_CLOSED, Waiter
from meshwise.runtime.spawn import spawn


class _Peer:
    """Rank 1 of a two-rank communicator, scripted to publish, return and close (or exit) exactly while
    rank 0's slow path runs its checks — the interleaving seen at 64 ranks."""

    def __init__(self, exits: bool) -> None:
        self.published = False
        self.closed = False
        self.exits = exits

    def read_abort(self, peer: int) -> int:
        if peer == 1 and not self.published:
            self.published = True  # publishes, finishes the call and closes right now
            self.closed = not self.exits
        return ABORT_CLOSED if peer == 1 and self.closed else 0

    def pending(self) -> list[int]:
        return [] if self.published else [1]


def _waiter(peer: _Peer, identity_of_1) -> Waiter:
    return Waiter(0, 5.0, [None, identity_of_1], peer.read_abort, lambda code: None)


def test_a_peer_that_publishes_then_closes_during_the_check_is_not_blamed():
    peer = _Peer(exits=False)
    _waiter(peer, None).wait(lambda: peer.published, "all_gather", [1], pending=peer.pending)
    assert peer.published


def test_a_peer_that_finished_and_exited_is_not_blamed_but_a_pending_dead_one_is():
    gone = (os.getpid(), -1)  # a start time no live process has: rank 1's process is gone
    peer = _Peer(exits=True)
    _waiter(peer, gone).wait(lambda: peer.published, "all_gather", [1], pending=peer.pending)
    stuck = Waiter(0, 5.0, [None, gone], lambda p: 0, lambda code: None)
    with pytest.raises(PeerFailureError, match=r"rank 0 · all_gather\] rank 1 \(pid \d+\) died"):
        stuck.wait(lambda: False, "all_gather", [1], pending=lambda: [1])


def _open_gather_close(rounds: int, calls: int):
    """Many communicators, each used for a few tiny all_gathers and closed at once by ranks that leave
    at different moments: every close races with peers still inside their last call."""
    world = meshwise.init("gloo", timeout=30)
    n, rank = world.world_size, world.rank
    ok = True
    for r in range(rounds):
        shm = ShmCommunicator.from_process_group(None, timeout=30, segment_bytes=64 * 1024)
        for c in range(calls):
            out = [torch.empty(1) for _ in range(n)]
            shm.all_gather(out, torch.tensor([float(rank + r + c)]))
            ok &= [t.item() for t in out] == [float(p + r + c) for p in range(n)]
        shm.close()
    meshwise.shutdown()
    return ok


def test_many_ranks_closing_right_after_tiny_all_gathers_never_fail_falsely():
    assert spawn(_open_gather_close, 16, args=(20, 2), timeout=100) == [True] * 16
