"""The shm collectives, each a sequence of phases (see :mod:`meshwise.comm.shm.phase`).

Data never passes through Python objects: every copy and reduction is one vectorised torch op on views
of the mapped regions. Messages larger than a region are cut into chunks, one phase (or two) each, so
memory stays bounded. all_reduce of small messages, or on two ranks, is a single phase where every rank
reduces all peers' chunks itself ("everyone reads everyone": one sync, no extra round); larger messages
on more ranks use reduce-scatter then all-gather in two phases, so each rank reduces only 1/n of the
data and the n ranks share the work, as in the ring algorithm but with direct reads instead of n-1 hops.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from meshwise.comm.api import SUPPORTED_DTYPES, Collective, ReduceOp, accumulator_dtype
from meshwise.comm.shm.phase import PhaseEngine, reduce_into, signature
from meshwise.comm.splits import first_mismatch

#: all_reduce messages up to this size use the one-phase path on any number of ranks
SMALL_ALL_REDUCE_BYTES = 256 * 1024

#: signature codes: the collectives, then barrier
_OPS = (*Collective, "barrier")


_OP_CODES = {op: code for code, op in enumerate(ReduceOp)}


def _sig(op: str, dtype: torch.dtype | None, *parts: int) -> int:
    code = SUPPORTED_DTYPES.index(dtype) if dtype is not None else -1
    return signature(_OPS.index(op), code, *parts)


def chunks_of(total: int, cap: int) -> range:
    """Start offsets of the chunks of a ``total``-element message, ``.step`` elements each (≤ ``cap``).

    As few chunks as fit, of equal length rather than full ones plus a remainder: 4 ranks cutting a
    4 MiB all_reduce 2 + 2 MiB instead of 3 + 1 MiB ran 9–17 % faster in paired runs (each chunk's
    regions, inputs and outputs stay cache-sized). Lengths are rounded up to 16 elements so that chunks
    start as aligned as the message does."""
    if total <= cap:
        return range(0, total, max(total, 1))
    chunks = -(-total // cap)
    even = -(-total // chunks)
    return range(0, total, min(cap, -(-even // 16) * 16))


def _reduce_to(out: torch.Tensor, sources: list[torch.Tensor], op: ReduceOp, n: int) -> None:
    """Reduce into ``out``, through a float32 scratch when ``out`` is half precision."""
    acc = accumulator_dtype(out.dtype)
    if acc == out.dtype:
        reduce_into(out, sources, op, n)
        return
    scratch = torch.empty(out.shape, dtype=acc)
    reduce_into(scratch, sources, op, n)
    out.copy_(scratch)


def all_reduce(
    eng: PhaseEngine, flat: torch.Tensor, op: ReduceOp, source: torch.Tensor | None = None
) -> None:
    """Reduce into ``flat``; with ``source`` (same size, not overlapping) it reads from there instead, so an
    out-of-place call costs no extra copy."""
    n, rank, dtype = eng.n, eng.rank, flat.dtype
    source = flat if source is None else source
    cap = eng.capacity(dtype)
    sig = _sig("all_reduce", dtype, flat.numel(), _OP_CODES[op])
    one_phase = n <= 2 or flat.numel() * flat.element_size() <= SMALL_ALL_REDUCE_BYTES
    everyone = list(range(n))
    chunks = chunks_of(flat.numel(), cap)
    for start in chunks:
        part, given = flat[start : start + chunks.step], source[start : start + chunks.step]
        count = part.numel()
        e = eng.begin("all_reduce")
        if one_phase:
            eng.view(rank, e, dtype, count).copy_(given)
            eng.post(e, sig)
            eng.wait(e, eng.peers, "all_reduce")
            _reduce_to(part, [eng.view(p, e, dtype, count) for p in everyone], op, n)
            continue
        # Peers reduce every slice but this rank's own, which it reduces itself straight from ``given``:
        # that slice is never copied into shared memory (1/n less copying).
        regions = _two_phase_regions(eng, dtype, count, e)
        lo, hi = regions.bounds[rank], regions.bounds[rank + 1]
        if lo:
            regions.head.copy_(given[:lo])
        if hi < count:
            regions.tail.copy_(given[hi:])
        eng.post(e, sig)
        eng.wait(e, eng.peers, "all_reduce")
        sources = [given[lo:hi] if p == rank else regions.inputs[p] for p in everyone]
        e2 = eng.begin("all_reduce")
        _reduce_to(regions.reduced[rank], sources, op, n)
        eng.post(e2, sig)
        eng.wait(e2, eng.peers, "all_reduce")
        for p, (a, b) in enumerate(itertools.pairwise(regions.bounds)):
            part[a:b].copy_(regions.reduced[p])


@dataclass(frozen=True)
class _TwoPhaseRegions:
    """The region views of one reduce-scatter + all-gather chunk: ``inputs[p]`` is this rank's slice
    in rank p's input region, ``reduced[p]`` rank p's reduced slice in its second-phase region,
    ``head``/``tail`` this rank's input region around its own slice."""

    bounds: list[int]
    head: torch.Tensor
    tail: torch.Tensor
    inputs: list[torch.Tensor]
    reduced: list[torch.Tensor]


#: cached views per (dtype, count, epoch parity); a handful of message sizes recur (DDP buckets)
_REGIONS_CACHED = 64


def _two_phase_regions(eng: PhaseEngine, dtype: torch.dtype, count: int, epoch: int) -> _TwoPhaseRegions:
    """The same views on every call of one shape, made once: on 4 ranks a chunk takes ~20 slices of
    region views, ~1 µs of Python each, paid twice over by ranks that share a core."""
    key = ("all_reduce", dtype, count, epoch & 1)
    cached = eng.memo.get(key)
    if cached is None:
        n, rank = eng.n, eng.rank
        bounds = [count * i // n for i in range(n + 1)]
        lo, hi = bounds[rank], bounds[rank + 1]
        mine = eng.view(rank, epoch, dtype, count)
        cached = _TwoPhaseRegions(
            bounds=bounds,
            head=mine[:lo],
            tail=mine[hi:],
            inputs=[eng.view(p, epoch, dtype, count)[lo:hi] for p in range(n)],
            reduced=[
                eng.view(p, epoch + 1, dtype, count)[a:b]
                for p, (a, b) in enumerate(itertools.pairwise(bounds))
            ],
        )
        if len(eng.memo) >= _REGIONS_CACHED:
            eng.memo.clear()
        eng.memo[key] = cached
    return cached


def reduce(eng: PhaseEngine, flat: torch.Tensor, root: int, op: ReduceOp) -> None:
    n, rank, dtype = eng.n, eng.rank, flat.dtype
    cap = eng.capacity(dtype)
    sig = _sig("reduce", dtype, flat.numel(), root, _OP_CODES[op])
    chunks = chunks_of(flat.numel(), cap)
    for start in chunks:
        part = flat[start : start + chunks.step]
        e = eng.begin("reduce")
        eng.view(rank, e, dtype, part.numel()).copy_(part)
        eng.post(e, sig)
        if rank == root:
            eng.wait(e, eng.peers, "reduce")
            _reduce_to(part, [eng.view(p, e, dtype, part.numel()) for p in range(n)], op, n)


def broadcast(eng: PhaseEngine, flat: torch.Tensor, root: int) -> None:
    rank, dtype = eng.rank, flat.dtype
    cap = eng.capacity(dtype)
    sig = _sig("broadcast", dtype, flat.numel(), root)
    chunks = chunks_of(flat.numel(), cap)
    for start in chunks:
        part = flat[start : start + chunks.step]
        e = eng.begin("broadcast")
        if rank == root:
            eng.view(rank, e, dtype, part.numel()).copy_(part)
        eng.post(e, sig)
        if rank != root:
            eng.wait(e, [root], "broadcast")
            part.copy_(eng.view(root, e, dtype, part.numel()))


def all_gather(eng: PhaseEngine, outputs: list[torch.Tensor], flat_in: torch.Tensor) -> None:
    rank, dtype = eng.rank, flat_in.dtype
    outs = [o.view(-1) for o in outputs]
    sizes = [o.numel() for o in outs]
    if outs[rank].data_ptr() != flat_in.data_ptr():
        outs[rank].copy_(flat_in)
    cap = eng.capacity(dtype)
    sig = _sig("all_gather", dtype, *sizes)
    chunks = chunks_of(max(sizes), cap)
    for start in chunks:
        e = eng.begin("all_gather")
        mine = flat_in[start : start + chunks.step]
        eng.view(rank, e, dtype, mine.numel()).copy_(mine)
        eng.post(e, sig)
        eng.wait(e, eng.peers, "all_gather")
        for p in eng.peers:
            piece = outs[p][start : start + chunks.step]
            piece.copy_(eng.view(p, e, dtype, piece.numel()))


def reduce_scatter(eng: PhaseEngine, out: torch.Tensor, inputs: list[torch.Tensor], op: ReduceOp) -> None:
    n, rank, dtype = eng.n, eng.rank, out.dtype
    ins = [t.view(-1) for t in inputs]
    sizes = [t.numel() for t in ins]
    per = eng.capacity(dtype, n)
    sig = _sig("reduce_scatter", dtype, _OP_CODES[op], *sizes)
    chunks = chunks_of(max(sizes), per)
    for start in chunks:
        e = eng.begin("reduce_scatter")
        for j, t in enumerate(ins):
            piece = t[start : start + chunks.step]
            if piece.numel():
                eng.view(rank, e, dtype, piece.numel(), part=j).copy_(piece)
        eng.post(e, sig)
        eng.wait(e, eng.peers, "reduce_scatter")
        target = out[start : start + chunks.step]
        if target.numel():
            _reduce_to(target, [eng.view(p, e, dtype, target.numel(), part=rank) for p in range(n)], op, n)


def all_to_all(eng: PhaseEngine, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
    n, rank, dtype = eng.n, eng.rank, inputs[0].dtype
    ins = [t.view(-1) for t in inputs]
    outs = [t.view(-1) for t in outputs]
    per = eng.capacity(dtype, n)
    sig = _sig("all_to_all", dtype)
    outs[rank].copy_(ins[rank])
    start, phases = 0, 1
    while start == 0 or start < phases * per:
        e = eng.begin("all_to_all")
        for j, t in enumerate(ins):
            piece = t[start : start + per]
            if j != rank and piece.numel():
                eng.view(rank, e, dtype, piece.numel(), part=j).copy_(piece)
        counts = [t.numel() for t in ins] + [t.numel() for t in outs]
        eng.post(e, sig, counts if start == 0 else None)
        eng.wait(e, eng.peers, "all_to_all")
        if start == 0:
            # every rank sees every rank's send and receive counts, so all raise the same error
            table = [eng.meta(p, e, 2 * n) for p in range(n)]
            wrong = first_mismatch([row[:n] for row in table], [row[n:] for row in table], "all_to_all")
            if wrong:
                raise eng.mismatch(wrong, "all_to_all")
            phases = max(1, -(-max(max(row[:n]) for row in table) // per))
        for p in eng.peers:
            piece = outs[p][start : start + per]
            if piece.numel():
                piece.copy_(eng.view(p, e, dtype, piece.numel(), part=rank))
        start += per


def scatter(eng: PhaseEngine, out: torch.Tensor, inputs: list[torch.Tensor] | None, root: int) -> None:
    n, rank, dtype = eng.n, eng.rank, out.dtype
    per = eng.capacity(dtype, n)
    sig = _sig("scatter", dtype, root)
    ins = [t.view(-1) for t in inputs] if inputs is not None else []
    if rank == root:
        out.copy_(ins[root])
    start, phases = 0, 1
    while start == 0 or start < phases * per:
        e = eng.begin("scatter")
        if rank == root:
            for j, t in enumerate(ins):
                piece = t[start : start + per]
                if j != root and piece.numel():
                    eng.view(rank, e, dtype, piece.numel(), part=j).copy_(piece)
            eng.post(e, sig, [t.numel() for t in ins] if start == 0 else None)
            phases = max(1, -(-max(t.numel() for t in ins) // per))
        else:
            eng.post(e, sig)
            eng.wait(e, [root], "scatter")
            if start == 0:
                sizes = eng.meta(root, e, n)
                if sizes[rank] != out.numel():
                    raise eng.mismatch(
                        f"root {root} scatters {sizes[rank]} elements to this rank but output holds "
                        f"{out.numel()}",
                        "scatter",
                    )
                phases = max(1, -(-max(sizes) // per))
            piece = out[start : start + per]
            if piece.numel():
                piece.copy_(eng.view(root, e, dtype, piece.numel(), part=rank))
        start += per


def gather(eng: PhaseEngine, flat_in: torch.Tensor, outputs: list[torch.Tensor] | None, root: int) -> None:
    n, rank, dtype = eng.n, eng.rank, flat_in.dtype
    cap = eng.capacity(dtype)
    sig = _sig("gather", dtype, root)
    outs = [t.view(-1) for t in outputs] if outputs is not None else []
    if rank == root:
        outs[root].copy_(flat_in)
    start, phases = 0, 1
    while start == 0 or start < phases * cap:
        e = eng.begin("gather")
        if rank == root:
            eng.post(e, sig, [t.numel() for t in outs] if start == 0 else None)
            phases = max(1, -(-max(t.numel() for t in outs) // cap))
            eng.wait(e, eng.peers, "gather")
            for p in eng.peers:
                piece = outs[p][start : start + cap]
                if piece.numel():
                    piece.copy_(eng.view(p, e, dtype, piece.numel()))
        else:
            mine = flat_in[start : start + cap]
            if mine.numel():
                eng.view(rank, e, dtype, mine.numel()).copy_(mine)
            eng.post(e, sig)
            if start == 0:
                eng.wait(e, [root], "gather")
                sizes = eng.meta(root, e, n)
                if sizes[rank] != flat_in.numel():
                    raise eng.mismatch(
                        f"root {root} expects {sizes[rank]} elements from this rank but input holds "
                        f"{flat_in.numel()}",
                        "gather",
                    )
                phases = max(1, -(-max(sizes) // cap))
        start += cap


def barrier(eng: PhaseEngine) -> None:
    e = eng.begin("barrier")
    eng.post(e, _sig("barrier", None))
    eng.wait(e, eng.peers, "barrier")
