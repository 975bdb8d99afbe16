"""The shm all_to_all's packed streams: the window arithmetic on its own (every rank in one process), then
the real exchange on 2 and 4 ranks against the definition, exactly (integers), through a region small
enough that the skewed cases take several phases, and the bad inputs named before anything moves."""

from __future__ import annotations

import ctypes
import random
import time

import pytest
import torch

from conftest import joined
from meshwise.comm.api import CollectiveMismatchError
from meshwise.comm.shm import ShmCommunicator
from meshwise.comm.shm.all_to_all import (
    spans_overlap,
    stream_length,
    stream_offsets,
    window_pieces,
    windows,
)
from meshwise.comm.shm.futex import futex_wait
from meshwise.runtime.spawn import spawn

SMALL = 64 * 1024  # the smallest segment: 32 KiB regions, 4096 int64 per phase


def test_stream_offsets_skip_the_block_a_rank_keeps():
    assert stream_offsets([3, 5, 0, 2], 1) == [0, 3, 3, 3]
    assert stream_length([3, 5, 0, 2], 1) == 5
    assert stream_offsets([4, 4], 0) == [0, 0]


def test_windows_cover_the_longest_stream_in_equal_parts_after_the_first():
    assert list(windows(10, 4, 10)) == [(0, 10)]  # one phase even when the streams are short
    assert list(windows(10, 0, 10)) == [(0, 10)]  # nothing to send still synchronises once
    assert list(windows(10, 31, 10)) == [(0, 10), (10, 17), (17, 24), (24, 31)]  # 21 left: 7 + 7 + 7
    assert list(windows(10, 20, 10)) == [(0, 10), (10, 20)]


def test_window_pieces_cut_blocks_at_the_window_edges():
    sends = [3, 5, 0, 4]  # rank 1 keeps its 5
    offsets = stream_offsets(sends, 1)
    assert list(window_pieces(sends, offsets, 1, 0, 4)) == [(0, 0, 0, 3), (3, 0, 3, 1)]
    assert list(window_pieces(sends, offsets, 1, 4, 8)) == [(3, 1, 0, 3)]


def _simulated(sends: list[list[int]], cap: int) -> list[list[list[int]]]:
    """Every rank's exchange through the windows, one process: what each rank receives from each."""
    n = len(sends)
    data = [[[1000 * i + 10 * j + k for k in range(sends[i][j])] for j in range(n)] for i in range(n)]
    got = [[[None] * sends[i][j] for i in range(n)] for j in range(n)]
    longest = max(stream_length(row, i) for i, row in enumerate(sends))
    for lo, hi in windows(cap, longest, cap):
        regions = [[None] * cap for _ in range(n)]
        for i in range(n):
            for j, at, w, count in window_pieces(sends[i], stream_offsets(sends[i], i), i, lo, hi):
                regions[i][w : w + count] = data[i][j][at : at + count]
        for j in range(n):
            for i in range(n):
                at, count = stream_offsets(sends[i], i)[j], sends[i][j]
                a, b = max(lo, at), min(hi, at + count)
                if i != j and a < b:
                    got[j][i][a - at : b - at] = regions[i][a - lo : b - lo]
        for i in range(n):
            got[i][i] = data[i][i]
    return [[got[j][i] == data[i][j] for i in range(n)] for j in range(n)]


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_every_block_arrives_whole_through_any_windows(n):
    rng = random.Random(n)
    for _ in range(30):
        sends = [[rng.choice([0, 0, 1, 7, 40]) for _ in range(n)] for _ in range(n)]
        for cap in (1, 5, 16, 300):
            assert all(all(row) for row in _simulated(sends, cap)), (sends, cap)


def test_spans_overlap_finds_in_place_slots_only():
    assert spans_overlap([(0, 8), (8, 16)], [(0, 8), (8, 16)])
    assert not spans_overlap([(100, 108)], [(0, 8), (8, 16)])
    assert spans_overlap([(12, 14)], [(0, 20), (4, 6)])  # inputs may overlap each other
    assert not spans_overlap([(20, 30)], [(0, 20), (4, 6), (30, 30)])  # empty spans never overlap


def test_futex_wait_returns_on_a_changed_word_and_times_out_on_an_unchanged_one():
    word = ctypes.c_int64(5)
    address = ctypes.addressof(word)
    started = time.monotonic()
    futex_wait(address, 4, 1.0)  # the word is not 4: no sleep at all
    futex_wait(address, 5, 0.02)  # unchanged: sleeps until the timeout
    elapsed = time.monotonic() - started
    assert 0.015 < elapsed < 0.9


def _rows(src: int, dst: int, n: int, case: str) -> int:
    """Rows rank ``src`` sends ``dst``: uneven with zero blocks, or skewed to rank 0 (several phases)."""
    if case == "uneven":
        return (3 * src + 5 * dst + 1) % 4 * 700  # 0, 700, 1400 or 2100 rows of 2 elements
    return 9000 if 0 in (src, dst) and src != dst else 500 * ((src + dst) % 2)


def _block(src: int, dst: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    base = (1_000_000 * src + 10_000 * dst) if dtype == torch.int64 else (10_000 * src + 1_000 * dst)
    values = base + torch.arange(2 * rows, dtype=torch.int64) % (1_000 if dtype == torch.int32 else 10**6)
    return values.to(dtype).reshape(rows, 2)


def _exchanges() -> list[str]:
    with joined("gloo", timeout=60):
        shm = ShmCommunicator.from_process_group(None, timeout=60, segment_bytes=SMALL)
        n, rank, problems = shm.world_size, shm.rank, []
        try:
            for case in ("uneven", "skewed"):
                for dtype in (torch.int64, torch.int32):
                    send = [_rows(rank, j, n, case) for j in range(n)]
                    recv = [_rows(i, rank, n, case) for i in range(n)]
                    source = torch.cat([_block(rank, j, send[j], dtype) for j in range(n)])
                    want = torch.cat([_block(i, rank, recv[i], dtype) for i in range(n)])
                    out = torch.full_like(want, -1)
                    shm.all_to_all_single(out, source, recv, send)
                    if not torch.equal(out, want):
                        problems.append(f"rank {rank} {case} {dtype}: single differs")
                    # the list form in place: received blocks must not overwrite blocks still to be sent
                    if case == "skewed":
                        slots = [_block(rank, j, send[j], dtype).clone() for j in range(n)]
                        shm.all_to_all(slots, slots)
                        if not all(
                            torch.equal(s, _block(i, rank, recv[i], dtype)) for i, s in enumerate(slots)
                        ):
                            problems.append(f"rank {rank} {case} {dtype}: in place differs")
            with pytest.raises(TypeError, match="mix dtypes"):
                shm.all_to_all_single(torch.zeros(2 * n, dtype=torch.int64), torch.zeros(2 * n))
            with pytest.raises(ValueError, match="add up to"):
                shm.all_to_all_single(torch.zeros(n), torch.zeros(n), [1] * n, [2] * n)
            # rank 0 sends 3 to rank 1, which expects 1: named on every rank, nobody hangs
            ins, outs = [1] * n, [1] * n
            ins[1] = 3 if rank == 0 else 1
            with pytest.raises(
                CollectiveMismatchError, match="rank 0 sends 3 elements to rank 1 but rank 1 expects 1"
            ):
                shm.all_to_all_single(torch.zeros(sum(outs)), torch.zeros(sum(ins)), outs, ins)
        finally:
            shm.close()
        return problems


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_packed_all_to_all_is_exact_on_shm(ranks):
    assert spawn(_exchanges, ranks, timeout=110) == [[]] * ranks
