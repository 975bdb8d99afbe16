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
    """Bytes of the buffers :class:`Case` allocates on ``rank`` for ``layout`` (guards aside): what the
    CLI adds up before launching, so that an oversized sweep is refused instead of OOM-killed."""
    slot = layout.count * layout.itemsize
    whole = layout.nbytes
    name = layout.collective
    if name in ("all_reduce", "broadcast", "reduce"):
        return whole
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


class Case:
    """One collective of a benchmark row on this rank: prepare inputs, run it, check it.

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
    ) -> None:
        self.comm, self.layout, self.dtype, self.op, self.root = comm, layout, dtype, op, root
        self.rank, self.n = comm.rank, comm.world_size
        self.device = device
        c, total = layout.count, layout.total_elements
        name = layout.collective
        self.result: Guarded | None = None  # the checked buffer (None: nothing to check on this rank)
        self.input: torch.Tensor | None = None
        if name in ("all_reduce", "broadcast", "reduce"):
            self.result = Guarded(c, dtype, device)
        elif name == "all_gather":
            self.input, self.result = self._plain(c), Guarded(total, dtype, device)
        elif name == "reduce_scatter":
            self.input, self.result = self._plain(total), Guarded(c, dtype, device)
        elif name == "all_to_all":
            self.input, self.result = self._plain(total), Guarded(total, dtype, device)
        elif name == "gather":
            self.input = self._plain(c)
            self.result = Guarded(total, dtype, device) if self.rank == root else None
        elif name == "scatter":
            self.input = self._plain(total) if self.rank == root else None
            self.result = Guarded(c, dtype, device)
        elif name == "sendrecv":
            self.input, self.result = self._plain(c), Guarded(c, dtype, device)
        else:
            raise ValueError(f"unknown collective {name!r}")
        self.run: Callable[[], None] = getattr(self, f"_run_{name}")

    def _plain(self, count: int) -> torch.Tensor:
        return torch.empty(count, dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------------ inputs
    def _values(self, rank: int, start: int, count: int, salt: int) -> torch.Tensor:
        return pattern(rank, start, count, self.dtype, self.op, self.n, salt)

    def prepare(self, salt: int | None) -> None:
        name = self.layout.collective
        if self.result is not None:
            self.result.reset()
        if salt is None:
            neutral = 1.0 if self.op is ReduceOp.PROD else 0.0
            if self.result is not None:
                self.result.view.fill_(neutral)
            if self.input is not None:
                self.input.fill_(neutral)
            return
        mine = self.rank
        if name in ("all_reduce", "reduce") or (name == "broadcast" and mine == self.root):
            self._fill(self.result.view, mine, salt)
        if self.input is not None:
            self._fill(self.input, mine, salt)

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
        if name == "all_to_all":
            return [((k,), r * c, c) for k in range(n)]
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
        if self.result is None:
            return 0, 0
        got = self.result.view
        if corrupt and got.numel() > 0:
            got[0] += 1
        wrong, position = 0, 0
        for ranks, offset, length in self._slots():
            for a in range(0, length, CHUNK_ELEMENTS):
                m = min(CHUNK_ELEMENTS, length - a)
                want = self._expected(ranks, offset + a, m, salt).to(self.dtype).to(got.device)
                wrong += int((got[position + a : position + a + m] != want).sum().item())
            position += length
        return wrong, self.result.out_of_bounds()

    # ------------------------------------------------------------------ operations
    def _run_all_reduce(self) -> None:
        self.comm.all_reduce(self.result.view, self.op)

    def _run_broadcast(self) -> None:
        self.comm.broadcast(self.result.view, self.root)

    def _run_reduce(self) -> None:
        self.comm.reduce(self.result.view, self.root, self.op)

    def _run_all_gather(self) -> None:
        self.comm.all_gather(self.result.view, self.input)

    def _run_reduce_scatter(self) -> None:
        self.comm.reduce_scatter(self.result.view, self.input, self.op)

    def _run_all_to_all(self) -> None:
        self.comm.all_to_all(self.result.view, self.input)

    def _run_gather(self) -> None:
        self.comm.gather(self.input, self.result.view if self.result is not None else None, self.root)

    def _run_scatter(self) -> None:
        self.comm.scatter(self.result.view, self.input, self.root)

    def _run_sendrecv(self) -> None:
        send = self.comm.isend(self.input, (self.rank + 1) % self.n)
        recv = self.comm.irecv(self.result.view, (self.rank - 1) % self.n)
        send.wait()
        recv.wait()
