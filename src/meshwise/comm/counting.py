"""``CountingCommunicator``: wrap any Communicator to count calls and bytes per operation.

Every strategy talks to a Communicator, so wrapping the one it is given is all the accounting needs:
``tp = CountingCommunicator(mesh.tp)`` then ``tp.stats`` after a step says what tensor parallelism sent.
Arguments are validated once (by the wrapper) and handed to the wrapped backend's primitives, so the
wrapper adds a dictionary update per call and nothing else.

Sizes follow nccl-tests (see ``comm/bus_factor.py``): ``bytes`` is S, the larger of one rank's send and
receive buffers — the tensor for all_reduce/broadcast/reduce/send/recv, all slots for all_gather (the
output), reduce_scatter and all_to_all (the input), scatter/gather (the root's buffer; other ranks count
their own slot times the group size). ``bus_bytes`` is S times the nccl-tests bus factor — 2(n−1)/n for
all_reduce, (n−1)/n for the slotted collectives, 1 otherwise — what each rank's link carries under a
bandwidth-optimal algorithm, so an all-reduce and the all-gather + reduce-scatter pair it decomposes into
compare equal. Groups split from a counting communicator are counted too, each in its own stats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from meshwise.comm.api import Collective, Communicator, ReduceOp, Work
from meshwise.comm.bus_factor import bus_factor


@dataclass
class OpCount:
    calls: int = 0
    bytes: int = 0
    bus_bytes: float = 0.0


@dataclass
class CommStats:
    """Calls and bytes per operation name, in first-use order."""

    world_size: int
    ops: dict[str, OpCount] = field(default_factory=dict)

    def record(self, op: str, nbytes: int) -> None:
        """Count one call of ``op`` (a :class:`Collective`, or "send"/"recv"/"barrier") moving ``nbytes``."""
        count = self.ops.setdefault(str(op), OpCount())
        count.calls += 1
        count.bytes += nbytes
        count.bus_bytes += nbytes * bus_factor(op, self.world_size)

    def reset(self) -> None:
        self.ops.clear()

    def calls(self, op: str) -> int:
        return self.ops[op].calls if op in self.ops else 0

    def bytes(self, op: str) -> int:
        return self.ops[op].bytes if op in self.ops else 0

    @property
    def total_bus_bytes(self) -> float:
        return sum(count.bus_bytes for count in self.ops.values())

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {
            op: {"calls": c.calls, "bytes": c.bytes, "bus_bytes": c.bus_bytes} for op, c in self.ops.items()
        }

    def table(self, title: str = "") -> str:
        """One line per operation: calls, bytes (S) and bus bytes, in MiB."""
        lines = [f"{title or 'communication'} ({self.world_size} ranks)"]
        lines.append(f"  {'op':<15} {'calls':>8} {'MiB':>12} {'bus MiB':>12}")
        for op, c in self.ops.items():
            lines.append(f"  {op:<15} {c.calls:>8} {c.bytes / 2**20:>12.3f} {c.bus_bytes / 2**20:>12.3f}")
        return "\n".join(lines)


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class CountingCommunicator(Communicator):
    """Forwards every operation to ``inner`` and records it in ``stats``."""

    def __init__(
        self, inner: Communicator, stats: CommStats | None = None, *, owns_inner: bool = False
    ) -> None:
        super().__init__(inner.rank, inner.world_size, inner.timeout)
        self.inner = inner
        self._owns_inner = owns_inner
        self.backend = inner.backend
        self.overlaps_compute = inner.overlaps_compute
        self.stats = stats if stats is not None else CommStats(inner.world_size)

    def __repr__(self) -> str:
        return f"CountingCommunicator({self.inner!r})"

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        self.stats.record("send", _nbytes([tensor]))
        return self.inner._isend(tensor, dst, tag)

    def _irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        self.stats.record("recv", _nbytes([tensor]))
        return self.inner._irecv(tensor, src, tag)

    def _broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        self.stats.record(Collective.BROADCAST, _nbytes([tensor]))
        return self.inner._broadcast(tensor, root)

    def _reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp) -> Work:
        self.stats.record(Collective.REDUCE, _nbytes([tensor]))
        return self.inner._reduce(tensor, root, op)

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        self.stats.record(Collective.ALL_REDUCE, _nbytes([tensor]))
        return self.inner._all_reduce(tensor, op)

    def _all_reduce_into(self, source: torch.Tensor, output: torch.Tensor, op: ReduceOp) -> Work:
        self.stats.record(Collective.ALL_REDUCE, _nbytes([source]))
        return self.inner._all_reduce_into(source, output, op)

    def _all_gather(self, outputs: list[torch.Tensor], input: torch.Tensor) -> Work:
        self.stats.record(Collective.ALL_GATHER, _nbytes(outputs))
        return self.inner._all_gather(outputs, input)

    def _reduce_scatter(self, output: torch.Tensor, inputs: list[torch.Tensor], op: ReduceOp) -> Work:
        self.stats.record(Collective.REDUCE_SCATTER, _nbytes(inputs))
        return self.inner._reduce_scatter(output, inputs, op)

    def _all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Work:
        self.stats.record(Collective.ALL_TO_ALL, _nbytes(inputs))
        return self.inner._all_to_all(outputs, inputs)

    def _scatter(self, output: torch.Tensor, inputs: list[torch.Tensor] | None, root: int) -> Work:
        self.stats.record(
            "scatter", _nbytes(inputs) if inputs is not None else _nbytes([output]) * self.world_size
        )
        return self.inner._scatter(output, inputs, root)

    def _gather(self, input: torch.Tensor, outputs: list[torch.Tensor] | None, root: int) -> Work:
        self.stats.record(
            "gather", _nbytes(outputs) if outputs is not None else _nbytes([input]) * self.world_size
        )
        return self.inner._gather(input, outputs, root)

    def _barrier(self) -> Work:
        self.stats.record("barrier", 0)
        return self.inner._barrier()

    def _split(self, ranks: list[int]) -> Communicator | None:
        sub = self.inner.split(ranks)
        return CountingCommunicator(sub, owns_inner=True) if sub is not None else None

    def close(self) -> None:
        """Close the wrapped communicator only if this wrapper created it (by ``split``)."""
        if self._owns_inner:
            self.inner.close()
