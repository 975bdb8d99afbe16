"""Run a :class:`Plan` on a Communicator's point-to-point operations.

Sends and receives are posted without blocking and tracked with the region they touch; a later step
waits only for the operations it actually depends on (reading a region a receive is still filling,
overwriting a region a send is still reading). Plans list receives before the sends of the same step,
so on every transport a message always finds its receive posted, and a pipelined ring forwards segment
s while segment s+1 is still in flight. Every wait is bounded by the communicator's timeout, and a
failure is re-raised naming the collective, the algorithm, the step and the peer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from meshwise.comm.algorithms.plan import Copy, Fence, Plan, Recv, Reduce, Region, Send
from meshwise.comm.api import CommError, Communicator, ReduceOp, Work

#: Tag of all algorithm traffic, apart from tags users pick for their own send/recv.
ALGORITHM_TAG = 0x6D77

Reducer = Callable[[torch.Tensor, torch.Tensor], None]


def _maximum(dst: torch.Tensor, src: torch.Tensor) -> None:
    torch.maximum(dst, src, out=dst)


def _minimum(dst: torch.Tensor, src: torch.Tensor) -> None:
    torch.minimum(dst, src, out=dst)


#: In-place ``dst = op(dst, src)``; AVG reduces as SUM and the caller divides once at the end.
REDUCERS: dict[ReduceOp, Reducer] = {
    ReduceOp.SUM: torch.Tensor.add_,
    ReduceOp.AVG: torch.Tensor.add_,
    ReduceOp.PROD: torch.Tensor.mul_,
    ReduceOp.MAX: _maximum,
    ReduceOp.MIN: _minimum,
}


class _Pending:
    __slots__ = ("peer", "region", "step", "what", "work")

    def __init__(self, what: str, peer: int, region: Region, step: int, work: Work) -> None:
        self.what, self.peer, self.region, self.step, self.work = what, peer, region, step, work


class PlanError(CommError):
    """Raised when a plan's step fails (wraps the transport's CommError with the algorithm context)."""


def execute(
    plan: Plan,
    comm: Communicator,
    buffers: Mapping[str, torch.Tensor],
    op: ReduceOp = ReduceOp.SUM,
) -> None:
    """Run ``plan`` with the named 1-D ``buffers`` (scratch buffers the plan needs are allocated here)."""
    bufs = dict(buffers)
    like = next(iter(bufs.values()))
    for name, size in plan.scratch.items():
        if name not in bufs or bufs[name].numel() < size:
            bufs[name] = torch.empty(size, dtype=like.dtype, device=like.device)
    reducer = REDUCERS[op]
    pending: list[_Pending] = []

    def view(region: Region) -> torch.Tensor:
        return bufs[region.buf][region.start : region.stop]

    def finish(entry: _Pending) -> None:
        try:
            entry.work.wait()
        except CommError as exc:
            cls = type(exc) if type(exc) is not CommError else PlanError
            raise cls(
                f"{plan.algo} {plan.collective}, step {entry.step}: {entry.what} with rank {entry.peer} "
                f"failed: {exc}",
                rank=comm.rank,
                op=plan.collective,
            ) from exc

    def settle(region: Region, *, writing: bool) -> None:
        """Wait for in-flight receives into ``region`` and, before overwriting it, sends out of it."""
        keep = []
        for entry in pending:
            if entry.region.overlaps(region) and (entry.what == "recv" or writing):
                finish(entry)
            else:
                keep.append(entry)
        pending[:] = keep

    for step in plan.ops:
        if isinstance(step, Recv):
            settle(step.dst, writing=True)
            work = comm.irecv(view(step.dst), step.peer, ALGORITHM_TAG)
            pending.append(_Pending("recv", step.peer, step.dst, step.step, work))
        elif isinstance(step, Send):
            settle(step.src, writing=False)
            work = comm.isend(view(step.src), step.peer, ALGORITHM_TAG)
            pending.append(_Pending("send", step.peer, step.src, step.step, work))
        elif isinstance(step, Reduce):
            settle(step.src, writing=False)
            settle(step.dst, writing=True)
            reducer(view(step.dst), view(step.src))
        elif isinstance(step, Copy):
            settle(step.src, writing=False)
            settle(step.dst, writing=True)
            view(step.dst).copy_(view(step.src))
        elif isinstance(step, Fence):
            for entry in pending:
                finish(entry)
            pending.clear()
    for entry in pending:
        finish(entry)
