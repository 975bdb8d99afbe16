"""all_to_all_single with per-rank split sizes (torch semantics) on gloo and shm: exact, empty splits,
rows of several elements, and split sizes that do not pair up named on every rank.

The full dtype matrix (and MPI) runs through :mod:`collective_matrix`'s ``single`` form; these tests pin
the contract MoE dispatch relies on, against a result computed from the definition.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import joined
from meshwise.bench.busbw import layout_for
from meshwise.bench.runner import SweepConfig, run_sweep
from meshwise.comm.algorithms.registry import predict_seconds
from meshwise.comm.api import CollectiveMismatchError
from meshwise.comm.cost.formulas import LinkParams, uneven_all_to_all_bytes
from meshwise.comm.shm import ShmCommunicator
from meshwise.comm.splits import first_mismatch, split_sizes
from meshwise.runtime.spawn import spawn


def rows_sent(src: int, dst: int) -> int:
    """Skewed and data-dependent like token routing: rank 0 gets most, some pairs send nothing."""
    return (3 * src + 5 * dst) % 4 if dst else 6 + src


def payload(src: int, n: int) -> torch.Tensor:
    """Rank ``src``'s input: row k of its block for rank j holds (1000·src + 100·j + k, -that)."""
    rows = [
        torch.tensor(
            [[1000 * src + 100 * j + k, -(1000 * src + 100 * j + k)] for k in range(rows_sent(src, j))]
        )
        for j in range(n)
    ]
    return torch.cat([r.reshape(-1, 2) for r in rows]).to(torch.int64)


def expected(dst: int, n: int) -> torch.Tensor:
    pieces = [
        torch.tensor(
            [[1000 * i + 100 * dst + k, -(1000 * i + 100 * dst + k)] for k in range(rows_sent(i, dst))]
        )
        for i in range(n)
    ]
    return torch.cat([p.reshape(-1, 2) for p in pieces]).to(torch.int64)


def _exchange(backend: str) -> list[str]:
    with joined("gloo", timeout=30) as world:
        comm = world.comm
        if backend == "shm":
            comm = ShmCommunicator.from_process_group(None, timeout=30, segment_bytes=64 << 10)
        n, rank, problems = comm.world_size, comm.rank, []
        send = [rows_sent(rank, j) for j in range(n)]
        recv = [rows_sent(i, rank) for i in range(n)]
        # the counts first, as MoE dispatch does: an even all_to_all_single of one integer per rank
        counts = torch.empty(n, dtype=torch.int64)
        comm.all_to_all_single(counts, torch.tensor(send, dtype=torch.int64))
        if counts.tolist() != recv:
            problems.append(f"rank {rank}: counts {counts.tolist()} != {recv}")
        out = torch.full((sum(counts.tolist()), 2), -7, dtype=torch.int64)
        work = comm.all_to_all_single(out, payload(rank, n), counts, send, async_op=True)
        work.wait()
        if not torch.equal(out, expected(rank, n)):
            problems.append(f"rank {rank}: got {out.tolist()} expected {expected(rank, n).tolist()}")
        # every split empty but one: a zero-size input on the ranks that send nothing
        lonely = torch.arange(4 * n, dtype=torch.int64) if rank == 0 else torch.empty(0, dtype=torch.int64)
        got = torch.full((4,), -7, dtype=torch.int64)
        comm.all_to_all_single(
            got, lonely, [4 if i == 0 else 0 for i in range(n)], [4] * n if rank == 0 else [0] * n
        )
        if got.tolist() != list(range(4 * rank, 4 * rank + 4)):
            problems.append(f"rank {rank}: from rank 0 got {got.tolist()}")
        if comm is not world.comm:
            comm.close()
        return problems


@pytest.mark.parametrize("backend", ["gloo", "shm"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_uneven_rows_arrive_exactly(backend, ranks):
    assert spawn(_exchange, ranks, args=(backend,), timeout=100) == [[]] * ranks


def _mismatched(backend: str) -> str:
    with joined("gloo", timeout=30) as world:
        comm = world.comm
        if backend == "shm":
            comm = ShmCommunicator.from_process_group(None, timeout=30, segment_bytes=64 << 10)
        # rank 0 sends 3 rows to rank 1, which expects 2
        ins, outs = ([1, 3], [1, 1]) if comm.rank == 0 else ([1, 2], [2, 2])
        try:
            comm.all_to_all_single(torch.zeros(sum(outs)), torch.ones(sum(ins)), outs, ins)
        except CollectiveMismatchError as exc:
            return str(exc)
        finally:
            if comm is not world.comm:
                comm.close()
        return "no error"


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_split_sizes_that_do_not_pair_up_are_named_on_every_rank(backend):
    messages = spawn(_mismatched, 2, args=(backend,), timeout=100)
    for rank, message in enumerate(messages):
        assert message.startswith(f"[rank {rank} · all_to_all] rank 0 sends 3 elements to rank 1 but rank 1 ")
        assert "expects 2 from rank 0" in message


def test_local_split_sizes_are_checked_before_anything_moves():
    assert split_sizes(None, 6, 3, "input", 0) == [2, 2, 2]
    assert split_sizes(torch.tensor([0, 5, 1]), 6, 3, "input", 0) == [0, 5, 1]
    assert split_sizes(np.array([3, 0, 3]), 6, 3, "input", 0) == [3, 0, 3]
    cases = [
        ([1, 2], 3, "must be 3 non-negative integers"),
        ([4, -1, 3], 6, "must be 3 non-negative integers"),
        ([2.0, 2, 2], 6, "must be 3 non-negative integers"),
        ([1, 2, 2], 6, "add up to 5 rows but input has 6"),
        (None, 7, "not divisible by the world size 3"),
    ]
    for sizes, rows, text in cases:
        with pytest.raises(ValueError, match=text) as info:
            split_sizes(sizes, rows, 3, "input", 1)
        assert str(info.value).startswith("[rank 1 · all_to_all_single]")


def test_first_mismatch_names_the_pair():
    sends = [[1, 2], [3, 4]]
    assert first_mismatch(sends, [[1, 3], [2, 4]], "all_to_all") is None
    assert first_mismatch(sends, [[1, 3], [5, 4]], "all_to_all") == (
        "rank 0 sends 2 elements to rank 1 but rank 1 expects 5 from rank 0 (check the all_to_all split "
        "sizes of both ranks)"
    )


def test_skewed_bench_layout_is_a_symmetric_hot_spot():
    layout = layout_for("all_to_all", 1024, 3, 4, skew=3)  # 256 elements = 7 slots of 36 (16-byte blocks)
    assert layout.count == 36 and layout.nbytes == 7 * 36 * 4
    matrix = [[layout.split(i, j) for j in range(3)] for i in range(3)]
    assert matrix == [[36, 108, 108], [108, 36, 36], [108, 36, 36]]
    assert [layout.rank_elements(r) for r in range(3)] == [252, 180, 180]
    assert layout_for("all_to_all", 1024, 3, 4).rank_elements(1) == 3 * 84  # even: nccl-tests' slots
    with pytest.raises(ValueError, match="all_to_all only"):
        layout_for("all_gather", 1024, 3, 4, skew=2)


def _skewed_sweeps() -> list[tuple[str, int, int, int]]:
    with joined("gloo", timeout=30) as world:
        shm = ShmCommunicator.from_process_group(None, timeout=30, segment_bytes=64 << 10)
        config = SweepConfig("all_to_all", (100, 40000), iters=2, warmup=1, checks=2, skew=4)
        verdicts = [
            (comm.backend, row.size, row.wrong, row.out_of_bounds)
            for comm in (world.comm, shm)
            for row in run_sweep(comm, world.comm, config, torch.device("cpu"))
        ]
        shm.close()
        return verdicts


def test_skewed_all_to_all_benchmark_checks_clean_on_gloo_and_shm():
    # 40000 B on 3 ranks through 64 KiB segments: the hot rank's slots stream in several phases
    verdicts = spawn(_skewed_sweeps, 3, timeout=100)[0]
    assert [(b, s) for b, s, _, _ in verdicts] == [("gloo", 0), ("gloo", 39888), ("shm", 0), ("shm", 39888)]
    assert all(wrong == oob == 0 for _, _, wrong, oob in verdicts), verdicts


def test_uneven_exchange_is_priced_by_its_busiest_rank():
    link = LinkParams(alpha=1e-5, beta=1e-9, gamma=0.0)
    even = [[100.0] * 4 for _ in range(4)]  # one rank's whole input: 400 bytes
    assert uneven_all_to_all_bytes(even) == pytest.approx(400)
    hot = [[100.0, 100, 100, 100]] + [[700.0, 100, 100, 100] for _ in range(3)]  # rank 0 receives 7x
    assert uneven_all_to_all_bytes(hot) == pytest.approx(3 * 700 * 4 / 3)
    balanced, skewed = (
        predict_seconds("all_to_all", "pairwise", uneven_all_to_all_bytes(m), 4, link) for m in (even, hot)
    )
    assert skewed - 3e-5 == pytest.approx(7 * (balanced - 3e-5))  # same latency, 7x the busiest bytes
    assert uneven_all_to_all_bytes([[5.0]]) == 0.0
