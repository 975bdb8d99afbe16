"""The collective test matrix: run every collective on a communicator under test and on a reference.

Backends (shm, mpi) and algorithm wrappers call :func:`check_collectives` from inside a multi-rank worker
with the communicator under test and a :class:`~meshwise.comm.native.NativeCommunicator` over the same
ranks. Every collective runs in every form (in place and out of place, even and uneven slots, every root)
for each dtype and reduce op, on inputs chosen so that float results are exact (small integers, products
of ±1 and 2), so results must match bit for bit; only AVG, which divides once, gets a one-ulp tolerance.
The function returns human-readable mismatch descriptions; an empty list means the communicator agrees
with the reference everywhere. Both communicators must be called by every rank in the same order, which
this function guarantees by iterating the same matrix on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from meshwise.comm.api import Collective, Communicator, ReduceOp

DEFAULT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64)
DEFAULT_OPS = tuple(ReduceOp)
DEFAULT_SIZES = (1, 7, 300)
COLLECTIVES = (*(c.value for c in Collective), "send_recv", "barrier")

_PROD_VALUES = (1.0, 2.0, -1.0, 1.0, -1.0)  # products over ≤ 8 ranks stay ≤ 2^8 in magnitude: exact


def values(rank: int, count: int, dtype: torch.dtype, op: ReduceOp | None, salt: int = 0) -> torch.Tensor:
    """Deterministic, exact-by-construction input of ``count`` elements for ``rank``.

    Small integers in [-5, 5] make SUM exact in every dtype (even bfloat16 over dozens of ranks); PROD
    uses ±1 and 2 so products stay tiny powers of two; unsigned-looking sums would hide sign bugs.
    """
    index = torch.arange(count, dtype=torch.int64)
    mixed = (index * 7 + rank * 13 + salt * 5) % 11
    if op is ReduceOp.PROD:
        table = torch.tensor(_PROD_VALUES, dtype=torch.float64)
        return table[mixed % len(_PROD_VALUES)].to(dtype)
    return (mixed - 5).to(dtype)


def uneven_counts(world_size: int, size: int) -> list[int]:
    """Per-rank slot sizes that differ between ranks (one of them empty when the world allows)."""
    return [(size * (r + 1)) % (size + 3) + (r % 2) for r in range(world_size)]


class _Matrix:
    """Runs each case on both communicators and records differences."""

    def __init__(self, comm: Communicator, reference: Communicator) -> None:
        if (comm.rank, comm.world_size) != (reference.rank, reference.world_size):
            raise ValueError(
                f"communicator (rank {comm.rank} of {comm.world_size}) and reference (rank "
                f"{reference.rank} of {reference.world_size}) must span the same ranks"
            )
        self.comm = comm
        self.reference = reference
        self.rank = comm.rank
        self.n = comm.world_size
        self.failures: list[str] = []

    def compare(self, case: str, got: torch.Tensor, want: torch.Tensor, op: ReduceOp | None) -> None:
        got, want = got.reshape(-1), want.reshape(-1)
        if got.shape != want.shape or got.dtype != want.dtype:
            self.failures.append(
                f"{case}: rank {self.rank} got shape {tuple(got.shape)}/{got.dtype}, "
                f"expected {tuple(want.shape)}/{want.dtype}"
            )
            return
        if op is ReduceOp.AVG:
            close = torch.isclose(got.double(), want.double(), rtol=torch.finfo(got.dtype).eps, atol=0)
            bad = (~close).nonzero()
        else:
            bad = (got != want).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            self.failures.append(
                f"{case}: rank {self.rank} differs at {bad.shape[0]} of {got.numel()} elements; first at "
                f"[{i}]: got {got[i].item()!r}, expected {want[i].item()!r}"
            )

    def both(self, run: Callable[[Communicator], list[torch.Tensor]]) -> tuple[list, list]:
        return run(self.comm), run(self.reference)

    # ------------------------------------------------------------------ cases
    def all_reduce(self, dtype: torch.dtype, op: ReduceOp, size: int) -> None:
        x = (
            values(self.rank, size, dtype, op).reshape(size, 1)
            if size > 1
            else values(self.rank, 1, dtype, op)
        )

        def in_place(c: Communicator) -> list[torch.Tensor]:
            t = x.clone()
            c.all_reduce(t, op)
            return [t]

        def out_of_place(c: Communicator) -> list[torch.Tensor]:
            t, out = x.clone(), torch.full_like(x, 9)
            work = c.all_reduce(t, op, output=out, async_op=True)
            assert work is not None
            work.wait()
            return [out, t]

        for form, run in (("in-place", in_place), ("out-of-place async", out_of_place)):
            got, want = self.both(run)
            for g, w in zip(got, want, strict=True):
                self.compare(f"all_reduce {form} {dtype} {op.value} n={size}", g, w, op)

    def reduce(self, dtype: torch.dtype, op: ReduceOp, size: int) -> None:
        x = values(self.rank, size, dtype, op, salt=1)
        for root in range(self.n):

            def run(c: Communicator, root: int = root) -> list[torch.Tensor]:
                t = x.clone()
                c.reduce(t, root, op)
                return [t]

            got, want = self.both(run)
            self.compare(f"reduce root={root} {dtype} {op.value} n={size}", got[0], want[0], op)

    def broadcast(self, dtype: torch.dtype, size: int) -> None:
        for root in range(self.n):

            def run(c: Communicator, root: int = root) -> list[torch.Tensor]:
                t = values(self.rank, size, dtype, None, salt=2)
                c.broadcast(t, root)
                return [t]

            got, want = self.both(run)
            self.compare(f"broadcast root={root} {dtype} n={size}", got[0], want[0], None)

    def all_gather(self, dtype: torch.dtype, size: int) -> None:
        n, rank = self.n, self.rank
        mine = values(rank, size, dtype, None, salt=3)

        def flat_out(c: Communicator) -> list[torch.Tensor]:
            out = torch.full((n * size,), 9, dtype=dtype)
            c.all_gather(out, mine.clone())
            return [out]

        def flat_in_place(c: Communicator) -> list[torch.Tensor]:
            out = torch.full((n * size,), 9, dtype=dtype)
            out[rank * size : (rank + 1) * size] = mine
            c.all_gather(out, out[rank * size : (rank + 1) * size])
            return [out]

        counts = uneven_counts(n, size)
        own = values(rank, counts[rank], dtype, None, salt=4)

        def uneven(c: Communicator) -> list[torch.Tensor]:
            outs = [torch.full((k,), 9, dtype=dtype) for k in counts]
            c.all_gather(outs, own.clone())
            return outs

        for form, run in (("flat", flat_out), ("in-place", flat_in_place), ("uneven", uneven)):
            got, want = self.both(run)
            for g, w in zip(got, want, strict=True):
                self.compare(f"all_gather {form} {dtype} n={size}", g, w, None)

    def reduce_scatter(self, dtype: torch.dtype, op: ReduceOp, size: int) -> None:
        n, rank = self.n, self.rank
        flat = values(rank, n * size, dtype, op, salt=5)

        def even(c: Communicator) -> list[torch.Tensor]:
            out, inp = torch.full((size,), 9, dtype=dtype), flat.clone()
            c.reduce_scatter(out, inp, op)
            return [out, inp]

        def in_place(c: Communicator) -> list[torch.Tensor]:
            inp = flat.clone()
            c.reduce_scatter(inp[rank * size : (rank + 1) * size], inp, op)
            return [inp[rank * size : (rank + 1) * size]]

        counts = uneven_counts(n, size)
        slots = [values(rank, k, dtype, op, salt=6 + j) for j, k in enumerate(counts)]

        def uneven(c: Communicator) -> list[torch.Tensor]:
            out = torch.full((counts[rank],), 9, dtype=dtype)
            c.reduce_scatter(out, [s.clone() for s in slots], op)
            return [out]

        for form, run in (("even", even), ("in-place", in_place), ("uneven", uneven)):
            got, want = self.both(run)
            for g, w in zip(got, want, strict=True):
                self.compare(f"reduce_scatter {form} {dtype} {op.value} n={size}", g, w, op)

    def all_to_all(self, dtype: torch.dtype, size: int) -> None:
        n, rank = self.n, self.rank
        flat = values(rank, n * size, dtype, None, salt=7)

        def even(c: Communicator) -> list[torch.Tensor]:
            out = torch.full((n * size,), 9, dtype=dtype)
            c.all_to_all(out, flat.clone())
            return [out]

        # rank i sends (i + j) % 3 + j elements to rank j; rank j therefore receives (i + j) % 3 + j from i.
        send_counts = [(rank + j) % 3 + j for j in range(n)]
        recv_counts = [(i + rank) % 3 + rank for i in range(n)]
        pieces = [values(rank, k, dtype, None, salt=8 + j) for j, k in enumerate(send_counts)]

        def uneven(c: Communicator) -> list[torch.Tensor]:
            outs = [torch.full((k,), 9, dtype=dtype) for k in recv_counts]
            c.all_to_all(outs, [p.clone() for p in pieces])
            return outs

        # all_to_all_single: rows of 2 elements, rank i sends (i + 2j) % 3 rows to rank j (some empty)
        rows_to = [(rank + 2 * j) % 3 for j in range(n)]
        rows_from = [(i + 2 * rank) % 3 for i in range(n)]
        table = values(rank, 2 * sum(rows_to), dtype, None, salt=9).reshape(-1, 2)

        def single(c: Communicator) -> list[torch.Tensor]:
            out = torch.full((sum(rows_from), 2), 9, dtype=dtype)
            c.all_to_all_single(out, table.clone(), rows_from, rows_to)
            return [out]

        for form, run in (("even", even), ("uneven", uneven), ("single", single)):
            got, want = self.both(run)
            for g, w in zip(got, want, strict=True):
                self.compare(f"all_to_all {form} {dtype} n={size}", g, w, None)
        # and against the definition: rank i's rows for this rank, in rank order
        expected = torch.cat(
            [
                values(i, 2 * sum((i + 2 * j) % 3 for j in range(n)), dtype, None, salt=9)
                .reshape(-1, 2)[sum((i + 2 * j) % 3 for j in range(rank)) :][: rows_from[i]]
                for i in range(n)
            ]
        )
        self.compare(f"all_to_all_single vs definition {dtype}", single(self.comm)[0], expected, None)

    def scatter_gather(self, dtype: torch.dtype, size: int, which: set[str]) -> None:
        n, rank = self.n, self.rank
        counts = uneven_counts(n, size)
        for root in range(self.n):
            for form, sizes in (("even", [size] * n), ("uneven", counts)):
                slots = [values(root, k, dtype, None, salt=20 + j) for j, k in enumerate(sizes)]

                def scatter(c: Communicator, root: int = root, sizes: list[int] = sizes, slots=slots):
                    out = torch.full((sizes[rank],), 9, dtype=dtype)
                    c.scatter(out, [s.clone() for s in slots] if rank == root else None, root)
                    return [out]

                def gather(c: Communicator, root: int = root, sizes: list[int] = sizes):
                    mine = values(rank, sizes[rank], dtype, None, salt=30)
                    outs = [torch.full((k,), 9, dtype=dtype) for k in sizes] if rank == root else None
                    c.gather(mine, outs, root)
                    return outs or []

                for name, run in (("scatter", scatter), ("gather", gather)):
                    if name not in which:
                        continue
                    got, want = self.both(run)
                    for g, w in zip(got, want, strict=True):
                        self.compare(f"{name} {form} root={root} {dtype} n={size}", g, w, None)

    def point_to_point(self, dtype: torch.dtype, size: int) -> None:
        if self.n == 1:
            return
        n, rank = self.n, self.rank

        def shift(c: Communicator) -> list[torch.Tensor]:
            incoming = torch.full((size,), 9, dtype=dtype)
            recv = c.irecv(incoming, (rank - 1) % n, tag=3)
            send = c.isend(values(rank, size, dtype, None, salt=40), (rank + 1) % n, tag=3)
            recv.wait()
            send.wait()
            return [incoming]

        got, want = self.both(shift)
        self.compare(f"isend/irecv ring shift {dtype} n={size}", got[0], want[0], None)
        expected = values((rank - 1) % n, size, dtype, None, salt=40)
        self.compare(f"isend/irecv ring shift vs hand-computed {dtype} n={size}", got[0], expected, None)
        if rank in (0, 1):  # blocking pair between ranks 0 and 1
            buf = values(rank, size, dtype, None, salt=41)
            if rank == 0:
                self.comm.send(buf, 1)
                self.comm.recv(buf, 1)
            else:
                other = torch.empty_like(buf)
                self.comm.recv(other, 0)
                self.comm.send(other, 0)
                buf = other
            self.compare(
                f"send/recv round trip {dtype} n={size}", buf, values(0, size, dtype, None, 41), None
            )

    def barrier(self) -> None:
        work = self.comm.barrier(async_op=True)
        assert work is not None
        work.wait()
        if not work.is_completed():
            self.failures.append(f"barrier: rank {self.rank} handle not completed after wait()")
        self.comm.barrier()


def check_collectives(
    comm: Communicator,
    reference: Communicator,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    ops: Sequence[ReduceOp | str] | None = None,
    sizes: Sequence[int] | None = None,
    collectives: Sequence[str] | None = None,
) -> list[str]:
    """Run the whole matrix on ``comm`` and ``reference``; return mismatch descriptions (empty = pass).

    ``sizes`` are element counts per slot (per rank for all_reduce/broadcast/reduce); the uneven forms
    derive different per-rank counts from each size. ``collectives`` restricts the run to some of
    :data:`COLLECTIVES` (e.g. those an algorithm implements); every rank must pass the same arguments.
    """
    chosen = set(collectives if collectives is not None else COLLECTIVES)
    if chosen - set(COLLECTIVES):
        raise ValueError(
            f"unknown collectives {sorted(chosen - set(COLLECTIVES))}; choose from {COLLECTIVES}"
        )
    matrix = _Matrix(comm, reference)
    chosen_ops = [ReduceOp(o) for o in (ops if ops is not None else DEFAULT_OPS)]
    reducing = [(name, getattr(matrix, name)) for name in ("all_reduce", "reduce", "reduce_scatter")]
    moving = [(name, getattr(matrix, name)) for name in ("broadcast", "all_gather", "all_to_all")]
    for dtype in dtypes if dtypes is not None else DEFAULT_DTYPES:
        reducible = [o for o in chosen_ops if dtype.is_floating_point or o is not ReduceOp.AVG]
        for size in sizes if sizes is not None else DEFAULT_SIZES:
            for op in reducible:
                for name, case in reducing:
                    if name in chosen:
                        case(dtype, op, size)
            for name, case in moving:
                if name in chosen:
                    case(dtype, size)
            if chosen & {"scatter", "gather"}:
                matrix.scatter_gather(dtype, size, chosen)
            if "send_recv" in chosen:
                matrix.point_to_point(dtype, size)
    if "barrier" in chosen:
        matrix.barrier()
    return matrix.failures
