"""all_to_all on shared memory as packed streams: one copy in, one copy out, one sync per phase.

Each rank lays the blocks it sends to its peers end to end, in rank order and without the block it
keeps, as one *stream*; phase k carries window k of every rank's stream through the rank's own region.
A rank copies its window in with one copy per block it cuts, publishes, and then copies the pieces
addressed to it straight out of each peer's region. The receiver finds its piece from the sender's
split sizes alone (the first phase publishes every rank's send and receive counts, so uneven sizes
need no extra round), and there is no handshake per pair: n ranks exchange through n regions with one
wait each per phase. Packing matters for uneven splits: a region cut into n fixed sub-regions, one per
destination, leaves the self sub-region and every small block's remainder empty while a hot pair takes
extra phases; the stream fills the region whatever the splits (4 ranks sending 4 MiB each fit one
3 MiB region).

The block a rank sends itself is copied directly while the peers write their first window. The window
arithmetic (:func:`stream_offsets`, :func:`window_pieces`, :func:`windows`) is plain functions of the
split sizes, tested without processes.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence

import torch

from meshwise.comm.shm.kernels import as_array, copy, size
from meshwise.comm.shm.phase import PhaseEngine
from meshwise.comm.splits import first_mismatch


def stream_offsets(sends: Sequence[int], rank: int) -> list[int]:
    """Where each destination's block starts in ``rank``'s stream (its own block has length 0 there)."""
    offsets, at = [], 0
    for j, count in enumerate(sends):
        offsets.append(at)
        if j != rank:
            at += count
    return offsets


def stream_length(sends: Sequence[int], rank: int) -> int:
    return sum(sends) - sends[rank]


def windows(first: int, total: int, cap: int) -> Iterator[tuple[int, int]]:
    """The phases' ``(start, stop)`` stream windows for the longest stream of ``total`` elements.

    The first window is ``first`` long (chosen before any rank knows the others' lengths); the rest of
    the stream is cut into as few windows of at most ``cap`` as hold it, of equal length rather than full
    ones plus a remainder, so no phase is a tiny straggler. Always at least one window (a call with
    nothing to send still synchronises once, so every rank sees the counts)."""
    yield 0, first
    rest = total - first
    if rest <= 0:
        return
    phases = -(-rest // cap)
    step = -(-rest // phases)
    for start in range(first, total, step):
        yield start, min(start + step, total)


def window_pieces(
    blocks: Sequence[int], offsets: Sequence[int], skip: int, lo: int, hi: int
) -> Iterator[tuple[int, int, int, int]]:
    """The parts of the blocks that fall in stream window ``[lo, hi)``: ``(block, offset in block,
    offset in window, length)``, skipping block ``skip`` (the one a rank keeps) and empty parts."""
    for j, (count, at) in enumerate(zip(blocks, offsets, strict=True)):
        if j == skip:
            continue
        a, b = max(lo, at), min(hi, at + count)
        if a < b:
            yield j, a - at, a - lo, b - a


def spans_overlap(outputs: Sequence[tuple[int, int]], inputs: Sequence[tuple[int, int]]) -> bool:
    """Whether any ``[start, stop)`` span of ``outputs`` shares a byte with one of ``inputs`` (which may
    overlap each other): sorted input starts and the running maximum of their stops answer each output
    span with one bisection, so a 64-rank call does not compare 4096 pairs."""
    spans = sorted((a, b) for a, b in inputs if a < b)
    starts = [a for a, _ in spans]
    reach = list(itertools.accumulate((b for _, b in spans), max))
    for a, b in outputs:
        last = bisect.bisect_left(starts, b) - 1  # the inputs that start before this span ends
        if a < b and last >= 0 and reach[last] > a:
            return True
    return False


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def all_to_all(eng: PhaseEngine, outputs: list[torch.Tensor], inputs: list[torch.Tensor], sig: int) -> None:
    """Slot j of ``inputs`` goes to rank j's output slot ``eng.rank``, through packed stream windows.

    In place (output slots that overlap input slots, as ``all_to_all(slots, slots)``) the inputs are
    copied aside first: a block arrives at a different place in the stream than the block that leaves
    from the same slot, so a received piece could overwrite data not yet sent."""
    if spans_overlap([_span(t) for t in outputs], [_span(t) for t in inputs]):
        inputs = list(torch.cat([t.reshape(-1) for t in inputs]).split([t.numel() for t in inputs]))
    rank, dtype = eng.rank, inputs[0].dtype
    ins = [as_array(t) for t in inputs]
    outs = [as_array(t) for t in outputs]
    sends = [size(t) for t in ins]
    mine = stream_offsets(sends, rank)
    cap = eng.capacity(dtype)
    lo, hi = 0, cap  # the first window is a whole region: no rank knows the others' lengths before it
    later: Iterator[tuple[int, int]] | None = None
    incoming: list[tuple[int, int, int]] = []
    while True:
        e = eng.begin("all_to_all")
        region = eng.view(rank, e, dtype, cap)
        for j, at, w, count in window_pieces(sends, mine, rank, lo, hi):
            copy(region[w : w + count], ins[j][at : at + count])
        if later is None:
            eng.post(e, sig, sends + [size(t) for t in outs])
            copy(outs[rank], ins[rank])  # useful work while the peers write their first window
            eng.wait(e, eng.peers, "all_to_all")
            rows = _agreed_sends(eng, e)
            incoming = [(p, stream_offsets(row, p)[rank], row[rank]) for p, row in enumerate(rows)]
            del incoming[rank]
            later = windows(cap, max(stream_length(row, p) for p, row in enumerate(rows)), cap)
            next(later)  # the first window, this one
        else:
            eng.post(e, sig)
            eng.wait(e, eng.peers, "all_to_all")
        for p, at, count in incoming:
            a, b = max(lo, at), min(hi, at + count)
            if a < b:
                copy(outs[p][a - at : b - at], eng.view(p, e, dtype, cap)[a - lo : b - lo])
        window = next(later, None)
        if window is None:
            return
        lo, hi = window


def _agreed_sends(eng: PhaseEngine, epoch: int) -> list[list[int]]:
    """Every rank's send counts, read from the first phase's meta words, once every pair agrees; all
    ranks read the same table, so a mismatch raises the same error naming the pair on every rank."""
    n = eng.n
    table = [eng.meta(p, epoch, 2 * n) for p in range(n)]
    sends = [row[:n] for row in table]
    wrong = first_mismatch(sends, [row[n:] for row in table], "all_to_all")
    if wrong:
        raise eng.mismatch(wrong, "all_to_all")
    return sends
