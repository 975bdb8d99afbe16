"""Buffers, exact-by-construction inputs and expected results of one benchmarked collective.

Every rank can compute every other rank's input (a pure function of rank, element index and a salt), so
each rank checks its own result locally against values computed in float64/int64 and cast once: small
integers make SUM exact in every supported dtype, PROD multiplies ±1 and at most eight 2s, MAX/MIN are
exact anyway, and AVG inputs are multiples of the world size so that the mean is an integer whatever the
order of summation and division. The tolerance is therefore 0 — any difference is a wrong element.

Each output buffer is a view into a larger one with guard elements on both sides filled with a sentinel;
a guard that changed is an out-of-bounds write (a bug raw-pointer transports such as shared memory can
have and a value check of the buffer alone would never see).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshwise.bench.busbw import Layout
from meshwise.comm.api import Communicator, ReduceOp

GUARD_ELEMENTS = 16
#: Inputs and references are generated in chunks of this many elements (bounded memory at any size).
CHUNK_ELEMENTS = 1 << 21
_SENTINEL = -123.0  # exact in every dtype, outside every input and every result of the check inputs
_PROD_TABLE = (1.0, -1.0, 2.0, 1.0, -1.0, 1.0)


def pattern(
    rank: int, start: int, count: int, dtype: torch.dtype, op: ReduceOp, world_size: int, salt: int
) -> torch.Tensor:
    """Elements ``start .. start+count`` of rank ``rank``'s check input, in float64 (exact)."""
    index = torch.arange(start, start + count, dtype=torch.int64)
    mixed = (index * 5 + rank * 3 + salt * 7) % 9
    if op is ReduceOp.PROD:
        table = torch.tensor(_PROD_TABLE, dtype=torch.float64)
        values = table[mixed % len(_PROD_TABLE)]
        return values if rank < 8 else values.sign()  # at most eight factors of 2: tiny powers of two
    values = (mixed - 4).to(torch.float64)
    return values * world_size if op is ReduceOp.AVG else values


def reduce_reference(parts: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """op over ``parts`` in float64 (exact for the check inputs)."""
    stacked = torch.stack(parts)
    if op is ReduceOp.SUM:
        return stacked.sum(0)
    if op is ReduceOp.AVG:
        return stacked.sum(0) / len(parts)
    if op is ReduceOp.PROD:
        return stacked.prod(0)
    if op is ReduceOp.MAX:
        return stacked.amax(0)
    return stacked.amin(0)


def buffer_bytes(layout: Layout, rank: int = 0, root: int = 0) -> int:
    """Bytes of the buffers :class:`Case` allocates on ``rank`` for ``layout`` (guards aside), out of
    place (the larger placement): what the CLI adds up before launching, so that an oversized sweep is
    refused instead of OOM-killed."""
    slot = layout.count * layout.itemsize
    whole = layout.nbytes
    name = layout.collective
    if name in ("all_reduce", "broadcast", "reduce"):
        return 2 * whole  # input and output
    if name in ("all_gather", "reduce_scatter"):
        return whole + slot
    if name in ("all_to_all", "sendrecv"):
        return 2 * whole
    return slot + (whole if rank == root else 0)  # gather, scatter: the root holds all slots


class Guarded:
    """A flat tensor of ``count`` elements with sentinel guards before and after it."""

    def __init__(self, count: int, dtype: torch.dtype, device: torch.device) -> None:
        self._whole = torch.empty(count + 2 * GUARD_ELEMENTS, dtype=dtype, device=device)
        self.view = self._whole[GUARD_ELEMENTS : GUARD_ELEMENTS + count]

    def reset(self) -> None:
        self._whole.fill_(_SENTINEL)

    def out_of_bounds(self) -> int:
        """Guard elements that no longer hold the sentinel."""
        guards = torch.cat([self._whole[:GUARD_ELEMENTS], self._whole[-GUARD_ELEMENTS:]])
        return int((guards != _SENTINEL).sum().item())


PLACEMENTS = ("out-of-place", "in-place")


class Case:
    """One collective of a benchmark row on this rank, out of place or in place: prepare, run, check.

    In place means what nccl-tests means: the operation's input is a part of its output (all_gather: this
    rank's slot of the output; reduce_scatter and scatter: the output is this rank's slot of the input;
    all_reduce, broadcast, reduce, all_to_all and sendrecv: one buffer). Out of place, input and output
    are separate buffers; broadcast and reduce, whose Communicator form is in place only, then copy the
    input into the output first, which is what an out-of-place call costs a user of that interface (the
    same as ``all_reduce(output=…)``'s default).

    ``prepare(None)`` fills timing inputs that stay finite however often the operation repeats in place
    (zeros, or ones for PROD); ``prepare(salt)`` fills the check inputs for ``salt``.
    """

    def __init__(
        self,
        comm: Communicator,
        layout: Layout,
        dtype: torch.dtype,
        op: ReduceOp,
        root: int,
        device: torch.device,
        *,
        in_place: bool = False,
    ) -> None:
        self.comm, self.layout, self.dtype, self.op, self.root = comm, layout, dtype, op, root
        self.rank, self.n = comm.rank, comm.world_size
        self.device, self.in_place = device, in_place
        name = layout.collective
        if name not in _BUFFERS:
            raise ValueError(f"unknown collective {name!r}")
        #: The buffer whose guards are watched (None: nothing to check here, e.g. non-roots of gather).
        self.guarded: Guarded | None = None
        #: The checked part of it, and the operation's input (either may alias the other in place).
        self.result: torch.Tensor | None = None
        self.input: torch.Tensor | None = None
        _BUFFERS[name](self)
        self.run: Callable[[], None] = getattr(self, f"_run_{name}")

    def _plain(self, count: int) -> torch.Tensor:
        return torch.empty(count, dtype=self.dtype, device=self.device)

    def _guard(self, count: int) -> torch.Tensor:
        self.guarded = Guarded(count, self.dtype, self.device)
        return self.guarded.view

    def _my_slot(self, whole: torch.Tensor) -> torch.Tensor:
        c = self.layout.count
        return whole[self.rank * c : (self.rank + 1) * c]

    # ------------------------------------------------------------------ buffers per collective
    def _one_buffer(self) -> None:
        """all_reduce, reduce, sendrecv, all_to_all: the input is the output in place."""
        elements = self.layout.rank_elements(self.rank)
        self.result = self._guard(elements)
        self.input = self.result if self.in_place else self._plain(elements)

    def _broadcast_buffers(self) -> None:
        self.result = self._guard(self.layout.count)
        if self.rank == self.root:
            self.input = self.result if self.in_place else self._plain(self.layout.count)

    def _all_gather_buffers(self) -> None:
        self.result = self._guard(self.layout.total_elements)
        self.input = self._my_slot(self.result) if self.in_place else self._plain(self.layout.count)

    def _gather_buffers(self) -> None:
        if self.rank != self.root:
            self.input = self._plain(self.layout.count)
            return
        self._all_gather_buffers()

    def _reduce_scatter_buffers(self) -> None:
        if self.in_place:
            self.input = self._guard(self.layout.total_elements)
            self.result = self._my_slot(self.input)
        else:
            self.input, self.result = self._plain(self.layout.total_elements), self._guard(self.layout.count)

    def _scatter_buffers(self) -> None:
        if self.rank == self.root:
            self._reduce_scatter_buffers()
        else:
            self.result = self._guard(self.layout.count)

    # ------------------------------------------------------------------ inputs
    def _values(self, rank: int, start: int, count: int, salt: int) -> torch.Tensor:
        return pattern(rank, start, count, self.dtype, self.op, self.n, salt)

    def prepare(self, salt: int | None) -> None:
        if self.guarded is not None:
            self.guarded.reset()
        if salt is None:
            neutral = 1.0 if self.op is ReduceOp.PROD else 0.0
            for buffer in (self.result, self.input):
                if buffer is not None:
                    buffer.fill_(neutral)
            return
        if self.input is not None:
            self._fill(self.input, self.rank, salt)

    def _fill(self, target: torch.Tensor, rank: int, salt: int) -> None:
        for a in range(0, target.numel(), CHUNK_ELEMENTS):
            m = min(CHUNK_ELEMENTS, target.numel() - a)
            target[a : a + m].copy_(self._values(rank, a, m, salt))

    def _slots(self) -> list[tuple[tuple[int, ...], int, int]]:
        """This rank's result as consecutive slots: (ranks whose inputs make it, offset in them, length).

        A slot made of several ranks is their reduction; an empty list means nothing to check here.
        """
        name, c, n, r = self.layout.collective, self.layout.count, self.n, self.rank
        everyone = tuple(range(n))
        if name == "all_reduce" or (name == "reduce" and r == self.root):
            return [(everyone, 0, c)]
        if name == "reduce":
            return [((r,), 0, c)]  # non-roots keep their input
        if name == "broadcast":
            return [((self.root,), 0, c)]
        if name in ("all_gather", "gather"):
            return [((k,), 0, c) for k in range(n)]
        if name == "reduce_scatter":
            return [(everyone, r * c, c)]
        if name == "all_to_all":  # from rank k: its slot for this rank, after its slots for ranks < r
            split = self.layout.split
            return [((k,), sum(split(k, j) for j in range(r)), split(k, r)) for k in range(n)]
        if name == "scatter":
            return [((self.root,), r * c, c)]
        return [(((r - 1) % n,), 0, c)]  # sendrecv: from the previous rank

    def _expected(self, ranks: tuple[int, ...], start: int, count: int, salt: int) -> torch.Tensor:
        """float64 reference of one chunk: a copy of one rank's input, or the reduction of several."""
        parts = [self._values(k, start, count, salt) for k in ranks]
        return parts[0] if len(parts) == 1 else reduce_reference(parts, self.op)

    def check(self, salt: int, *, corrupt: bool = False) -> tuple[int, int]:
        """(wrong elements, out-of-bounds writes) of this rank after ``prepare(salt)`` and ``run()``.

        The reference is computed chunk by chunk so that checking a 1 GiB buffer needs tens of MiB.
        ``corrupt`` adds 1 to the first result element first: the test hook that proves a wrong value
        is counted and fails the run.
        """
        if self.result is None or self.guarded is None:
            return 0, 0
        got = self.result
        if corrupt and got.numel() > 0:
            got[0] += 1
        wrong, position = 0, 0
        for ranks, offset, length in self._slots():
            for a in range(0, length, CHUNK_ELEMENTS):
                m = min(CHUNK_ELEMENTS, length - a)
                want = self._expected(ranks, offset + a, m, salt).to(self.dtype).to(got.device)
                wrong += int((got[position + a : position + a + m] != want).sum().item())
            position += length
        return wrong, self.guarded.out_of_bounds()

    # ------------------------------------------------------------------ operations
    def _run_all_reduce(self) -> None:
        if self.in_place:
            self.comm.all_reduce(self.result, self.op)
        else:
            self.comm.all_reduce(self.input, self.op, output=self.result)

    def _run_broadcast(self) -> None:
        if not self.in_place and self.input is not None:
            self.result.copy_(self.input)
        self.comm.broadcast(self.result, self.root)

    def _run_reduce(self) -> None:
        if not self.in_place:
            self.result.copy_(self.input)
        self.comm.reduce(self.result, self.root, self.op)

    def _run_all_gather(self) -> None:
        self.comm.all_gather(self.result, self.input)

    def _run_reduce_scatter(self) -> None:
        self.comm.reduce_scatter(self.result, self.input, self.op)

    def _run_all_to_all(self) -> None:
        if self.layout.skew == 1:
            self.comm.all_to_all(self.result, self.input)
            return
        splits = [self.layout.split(self.rank, j) for j in range(self.n)]  # symmetric: sent = received
        if self.in_place:
            slots = list(self.result.split(splits))
            self.comm.all_to_all(slots, slots)
        else:
            self.comm.all_to_all_single(self.result, self.input, splits, splits)

    def _run_gather(self) -> None:
        self.comm.gather(self.input, self.result, self.root)

    def _run_scatter(self) -> None:
        self.comm.scatter(self.result, self.input, self.root)

    def _run_sendrecv(self) -> None:
        """Send to the next rank, receive from the previous one. In place the receive overwrites the
        buffer being sent; two-sided messages cannot order every send before every receive without a
        deadlock (each rank would wait on its neighbour), so the send goes out of a copy taken first."""
        outgoing = self.input.clone() if self.in_place else self.input
        send = self.comm.isend(outgoing, (self.rank + 1) % self.n)
        recv = self.comm.irecv(self.result, (self.rank - 1) % self.n)
        send.wait()
        recv.wait()


_BUFFERS: dict[str, Callable[[Case], None]] = {
    "all_reduce": Case._one_buffer,
    "reduce": Case._one_buffer,
    "sendrecv": Case._one_buffer,
    "all_to_all": Case._one_buffer,
    "broadcast": Case._broadcast_buffers,
    "all_gather": Case._all_gather_buffers,
    "gather": Case._gather_buffers,
    "reduce_scatter": Case._reduce_scatter_buffers,
    "scatter": Case._scatter_buffers,
}
