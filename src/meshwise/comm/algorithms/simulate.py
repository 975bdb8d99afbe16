"""Run every rank's plan in one process, on NumPy arrays, with the executor's rules.

Plans are data, so their correctness can be proved without processes: the simulator posts sends and
receives without blocking, waits only on data hazards (a receive into a region, or a write over a region
still being sent), matches messages first-in first-out per ordered pair of ranks, and raises
:class:`PlanDeadlock` when no rank can progress or :class:`PlanMismatch` when a send meets a receive of
another size or a message is left unmatched. Fed symbolic data — element i of rank r a vector that counts
how often each rank's contribution is in it (:func:`one_hot`) — it shows that every element ends with
every contribution exactly once. The planner and pipeline schedules reuse it to check what they build.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from meshwise.comm.algorithms.plan import Copy, Fence, Plan, Recv, Reduce, Region, Send


class PlanDeadlock(RuntimeError):
    """No rank can take its next step: every one waits on a message that is never posted."""


class PlanMismatch(RuntimeError):
    """A send and its receive disagree on size, or a message is never matched."""


@dataclass
class _Posted:
    """One posted, not yet retired send or receive of a rank."""

    receiving: bool
    region: Region
    data: np.ndarray | None = None
    done: bool = False


@dataclass
class _Channel:
    """The unmatched sends and receives from one rank to another, in posting order."""

    sends: list[_Posted] = field(default_factory=list)
    recvs: list[_Posted] = field(default_factory=list)


def one_hot(rank: int, world_size: int, length: int) -> np.ndarray:
    """``length`` elements that each hold exactly rank ``rank``'s contribution."""
    out = np.zeros((length, world_size))
    out[:, rank] = 1
    return out


def unknown(length: int, world_size: int) -> np.ndarray:
    """``length`` elements not yet written (NaN, so any use of them shows in the result)."""
    return np.full((length, world_size), np.nan)


class _Run:
    """The state of one simulation: every rank's buffers, program counter and posted messages."""

    def __init__(self, plans: list[Plan], buffers: list[dict[str, np.ndarray]]) -> None:
        self.plans = plans
        p = len(plans)
        self.bufs = [dict(b) for b in buffers]
        for rank, plan in enumerate(plans):
            for name, size in plan.scratch.items():
                if name not in self.bufs[rank] or len(self.bufs[rank][name]) < size:
                    self.bufs[rank][name] = unknown(size, p)
        self.pc = [0] * p
        self.pending: list[list[_Posted]] = [[] for _ in range(p)]
        self.channels: dict[tuple[int, int], _Channel] = {}

    def view(self, rank: int, region: Region) -> np.ndarray:
        return self.bufs[rank][region.buf][region.start : region.stop]

    def _hazard(self, entry: _Posted, region: Region | None, writing: bool) -> bool:
        """Whether ``entry`` must finish before the rank touches ``region`` (None: a fence, everything)."""
        if region is None:
            return True
        return entry.region.overlaps(region) and (entry.receiving or writing)

    def ready(self, rank: int, region: Region | None, writing: bool) -> bool:
        """Retire the finished messages that guard ``region``; False while one of them is in flight."""
        guarding = [e for e in self.pending[rank] if self._hazard(e, region, writing)]
        if not all(e.done for e in guarding):
            return False
        self.pending[rank] = [e for e in self.pending[rank] if not self._hazard(e, region, writing)]
        return True

    def post(self, src: int, dst: int, entry: _Posted, owner: int) -> None:
        self.pending[owner].append(entry)
        channel = self.channels.setdefault((src, dst), _Channel())
        (channel.recvs if entry.receiving else channel.sends).append(entry)
        while channel.sends and channel.recvs:
            send, recv = channel.sends.pop(0), channel.recvs.pop(0)
            if len(send.region) != len(recv.region):
                raise PlanMismatch(
                    f"rank {src} sends {len(send.region)} elements, rank {dst} expects {len(recv.region)}"
                )
            self.view(dst, recv.region)[:] = send.data
            send.done = recv.done = True

    def step(self, rank: int, op: Send | Recv | Reduce | Copy | Fence) -> bool:
        """Take ``op`` on ``rank`` if its data is ready; False when it must wait."""
        if isinstance(op, Recv):
            if not self.ready(rank, op.dst, True):
                return False
            self.post(op.peer, rank, _Posted(True, op.dst), rank)
        elif isinstance(op, Send):
            if not self.ready(rank, op.src, False):
                return False
            self.post(rank, op.peer, _Posted(False, op.src, self.view(rank, op.src).copy()), rank)
        elif isinstance(op, Reduce | Copy):
            if not (self.ready(rank, op.src, False) and self.ready(rank, op.dst, True)):
                return False
            if isinstance(op, Reduce):
                self.view(rank, op.dst)[:] += self.view(rank, op.src)
            else:
                self.view(rank, op.dst)[:] = self.view(rank, op.src)
        elif not self.ready(rank, None, True):  # Fence
            return False
        return True

    def run(self) -> list[dict[str, np.ndarray]]:
        while not all(pc == len(plan.ops) for pc, plan in zip(self.pc, self.plans, strict=True)):
            progressed = False
            for rank, plan in enumerate(self.plans):
                while self.pc[rank] < len(plan.ops) and self.step(rank, plan.ops[self.pc[rank]]):
                    self.pc[rank] += 1
                    progressed = True
            if not progressed:
                raise PlanDeadlock(f"no rank can progress; program counters {self.pc}")
        for rank, posted in enumerate(self.pending):
            if not all(e.done for e in posted):
                raise PlanMismatch(f"rank {rank} has unmatched messages")
        for (src, dst), channel in self.channels.items():
            if channel.sends or channel.recvs:
                raise PlanMismatch(f"unmatched messages between rank {src} and rank {dst}")
        return self.bufs


def simulate(plans: list[Plan], buffers: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """Run ``plans`` (one per rank, in rank order) on copies of ``buffers`` (named arrays per rank, rows
    being elements); scratch buffers a plan needs start :func:`unknown`. Returns every rank's buffers."""
    return _Run(plans, buffers).run()
