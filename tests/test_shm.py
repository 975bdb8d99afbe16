"""The shared-memory backend: bit-exact against gloo, chunked streaming, isolation, failures, sizing."""

import multiprocessing as mp
import os
import platform
import signal
import threading
import time
import warnings

import pytest
import torch

import meshwise
from collective_matrix import check_collectives
from meshwise.cli.info import render
from meshwise.comm.api import CollectiveMismatchError, CommError, CommTimeoutError, ReduceOp
from meshwise.comm.shm import ShmCommunicator, ShmSpaceError, check_memory_model, plan_layout
from meshwise.comm.shm.collectives import chunks_of
from meshwise.comm.shm.segment import MIN_REGION_BYTES, Layout
from meshwise.runtime.spawn import free_port, rank_environment, spawn
from meshwise.sysinfo import collect
from meshwise.world import resolve_backend

SMALL = 64 * 1024  # the smallest segment: 32 KiB collective regions, 4 KiB mailboxes


def _matrix(segment_bytes, sizes, dtypes, ops):
    world = meshwise.init("gloo", timeout=30)
    shm = ShmCommunicator.from_process_group(None, timeout=30, segment_bytes=segment_bytes)
    failures = check_collectives(shm, world.comm, sizes=sizes, dtypes=dtypes, ops=ops)
    shm.close()
    meshwise.shutdown()
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
def test_collective_matrix_is_bit_exact_against_gloo(ranks):
    # every dtype up to 4 ranks; 5 ranks (odd, more ranks than cores) keeps one float, one half, one int
    dtypes = None if ranks <= 4 else (torch.float32, torch.bfloat16, torch.int64)
    failures = spawn(_matrix, ranks, args=(8 * 2**20, (1, 7, 300), dtypes, None), timeout=100)
    assert failures == [[]] * ranks


def test_chunked_streaming_through_a_tiny_segment():
    # 70000 elements = 280 KB of float32 per slot: every collective and p2p message, and the two-phase
    # all_reduce (above 256 KiB on 3 ranks), is cut into many chunks of the 32 KiB regions / 4 KiB mailboxes.
    dtypes = (torch.float32, torch.bfloat16, torch.int64)
    ops = (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG)
    failures = spawn(_matrix, 3, args=(SMALL, (70000,), dtypes, ops), timeout=100)
    assert failures == [[], [], []]


def test_four_ranks_two_phase_all_reduce_and_even_splits():
    # 4 ranks: the reduce-scatter + all-gather all_reduce (70000 float32 > 256 KiB), slots split 4 ways.
    ops = (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.AVG)
    failures = spawn(_matrix, 4, args=(8 * 2**20, (5, 70000), (torch.float32,), ops), timeout=100)
    assert failures == [[], [], [], []]


def _large_all_reduce(count, segment_bytes):
    world = meshwise.init("gloo", timeout=30)
    shm = ShmCommunicator.from_process_group(None, timeout=30, segment_bytes=segment_bytes)
    n, rank = world.world_size, world.rank
    x = (torch.arange(count, dtype=torch.int64) * (rank + 1)) % 1000
    want = x.clone()
    world.comm.all_reduce(want)
    shm.all_reduce(x)
    halves = torch.full((count,), 1.0 if rank == 0 else 2.0**-8, dtype=torch.bfloat16)
    shm.all_reduce(halves)  # bf16 step by step rounds 1 + 2^-8 back to 1 at every step
    shm.close()
    meshwise.shutdown()
    exact = torch.tensor(1.0 + (n - 1) * 2.0**-8).to(torch.bfloat16)  # rounded once, from float32
    return torch.equal(x, want), bool((halves == exact).all())


def _aliased_all_reduce():
    world = meshwise.init("gloo", timeout=30)
    shm = ShmCommunicator.from_process_group(None, timeout=30, segment_bytes=SMALL)
    x = torch.arange(70000, dtype=torch.int64) + world.rank
    want = x.clone()
    world.comm.all_reduce(want)
    shm.all_reduce(x, output=x)  # output aliases the source: must behave as in place
    buffer = torch.arange(10, dtype=torch.int64)
    try:
        shm.all_reduce(buffer[0:6], output=buffer[2:8])  # partial overlap: refused, not silently wrong
        refused = False
    except RuntimeError:
        refused = True
    shm.close()
    meshwise.shutdown()
    return torch.equal(x, want), refused


def _spin_rounds():
    meshwise.init("gloo", timeout=30)
    shm = ShmCommunicator.from_process_group(None, timeout=30, segment_bytes=SMALL)
    rounds = shm._phases.waiter.spin_rounds
    shm.close()
    meshwise.shutdown()
    return rounds


def test_waits_spin_less_when_ranks_outnumber_the_cores():
    ranks = 3
    crowded = ranks > len(os.sched_getaffinity(0))  # the ranks inherit this process's mask
    assert spawn(_spin_rounds, ranks, timeout=60) == [2 if crowded else 20] * ranks


def _many_shapes():
    world = meshwise.init("gloo", timeout=30)
    shm = ShmCommunicator.from_process_group(None, timeout=30, segment_bytes=SMALL)
    exact, cached = True, []
    for count in range(70_000, 70_000 + 80 * 16, 16):  # 80 shapes through the two-phase path
        x = torch.arange(count, dtype=torch.int32) % 97 + world.rank
        want = x.clone()
        world.comm.all_reduce(want)
        shm.all_reduce(x)
        exact = exact and torch.equal(x, want)
        cached.append(len(shm._phases.memo))
    shm.close()
    meshwise.shutdown()
    return exact, max(cached)


def test_cached_region_views_stay_exact_and_bounded_over_many_shapes():
    results = spawn(_many_shapes, 3, timeout=100)
    assert all(exact for exact, _ in results)
    assert all(0 < most <= 64 for _, most in results)


def test_out_of_place_all_reduce_with_aliased_output():
    assert spawn(_aliased_all_reduce, 3, timeout=60) == [(True, True)] * 3


@pytest.mark.parametrize("ranks", [2, 4])
def test_large_all_reduce_and_half_accumulation(ranks):
    assert spawn(_large_all_reduce, ranks, args=(300_000, SMALL), timeout=100) == [(True, True)] * ranks


def _subgroups():
    meshwise.init("gloo", timeout=30)
    shm = ShmCommunicator.from_process_group(None, timeout=30)
    rank = shm.rank
    sub = shm.split([2, 0])  # reordered: global 2 becomes sub-rank 0
    out = None
    if sub is not None:
        x = torch.tensor([10 * (rank + 1)], dtype=torch.int64)
        sub.all_reduce(x)
        y = torch.tensor([float(rank)])
        sub.broadcast(y, root=0)
        out = (sub.rank, sub.world_size, x.item(), y.item())
        sub.close()
    whole = torch.tensor([rank], dtype=torch.int32)
    shm.all_reduce(whole)  # the parent keeps working after the split
    # A send larger than the mailbox keeps streaming while its sender waits in collectives: rank 1's
    # blocking recv completes although rank 0 only waits on the send after the second barrier.
    big = torch.arange(300_000, dtype=torch.float64)  # 2.4 MB: more than both 512 KiB mailbox slots
    received = None
    if rank == 0:
        send = shm.isend(big, 1, tag=5)
    shm.barrier()
    if rank == 1:
        received = torch.empty_like(big)
        shm.recv(received, 0, tag=5)
        received = torch.equal(received, big)
    shm.barrier()
    if rank == 0:
        send.wait()
    shm.close()
    meshwise.shutdown()
    return out, whole.item(), received


def test_subgroups_reorder_ranks_and_p2p_progresses_during_collectives():
    results = spawn(_subgroups, 3, timeout=100)
    assert results[0] == ((1, 2, 40, 2.0), 3, None)
    assert results[1] == (None, 3, True)
    assert results[2] == ((0, 2, 40, 2.0), 3, None)


def _job(salt):
    meshwise.init("gloo", timeout=30)
    shm = ShmCommunicator.from_process_group(None, timeout=30, segment_bytes=SMALL)
    ok = True
    for step in range(40):
        x = torch.full((5000,), float(salt * 1000 + step + shm.rank))
        shm.all_reduce(x)
        ok &= bool((x == 2 * (salt * 1000 + step) + 1).all())
    token = shm.token
    shm.close()
    meshwise.shutdown()
    return ok, token


def test_two_concurrent_jobs_do_not_collide():
    results: dict[int, list] = {}

    def run(salt: int) -> None:
        results[salt] = spawn(_job, 2, args=(salt,), timeout=100)

    threads = [threading.Thread(target=run, args=(salt,)) for salt in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(110)
    assert [ok for ok, _ in results[1] + results[2]] == [True] * 4
    assert results[1][0][1] != results[2][0][1]  # each job drew its own segment token


def _doomed(victim, conn):
    meshwise.init("gloo", timeout=30)
    shm = ShmCommunicator.from_process_group(None, timeout=20, segment_bytes=SMALL)
    conn.send(("token", shm.token))
    x = torch.ones(200_000)
    if shm.rank == victim:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        while True:  # chunked all_reduces: the victim dies in the middle of one
            shm.all_reduce(x)
            x.fill_(1.0)
    except CommError as exc:
        conn.send(("error", type(exc).__name__, str(exc), time.monotonic() - start))
    conn.close()
    os._exit(0)  # the gloo control plane lost a rank: skip its teardown


def _environment_then(rank, port, target, args):
    os.environ.update(rank_environment(rank, 3, "127.0.0.1", port))
    target(*args)


def test_sigkill_mid_all_reduce_is_reported_and_leaks_nothing():
    ctx = mp.get_context("forkserver")
    port, victim = free_port(), 1
    pipes, procs = [], []
    for rank in range(3):
        receiver, sender = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_environment_then, args=(rank, port, _doomed, (victim, sender)))
        proc.start()
        sender.close()
        pipes.append(receiver)
        procs.append(proc)
    try:
        reports = {}
        for rank in (0, 2):
            assert pipes[rank].poll(60), f"rank {rank} never started"
            token = pipes[rank].recv()[1]
            assert pipes[rank].poll(60), f"rank {rank} did not report the failure"
            reports[rank] = pipes[rank].recv()
        procs[victim].join(30)
        assert procs[victim].exitcode == -signal.SIGKILL
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    for rank, (_, kind, message, seconds) in reports.items():
        assert kind == "PeerFailureError", message
        assert f"rank {victim}" in message and "all_reduce" in message and f"rank {rank}" in message
        assert seconds < 15  # detected while spinning, well inside the 20 s timeout
    assert [name for name in os.listdir("/dev/shm") if token in name] == []


def _mismatch_and_timeout():
    world = meshwise.init("gloo", timeout=30)
    shm = ShmCommunicator.from_process_group(None, timeout=2)
    out = []
    try:
        shm.all_reduce(torch.ones(4 if world.rank == 0 else 8))
    except CollectiveMismatchError as exc:
        out.append(str(exc))
    shm.close()
    shm = ShmCommunicator.from_process_group(None, timeout=2)
    start = time.monotonic()
    if world.rank == 0:
        try:
            shm.barrier()
        except CommTimeoutError as exc:
            out.append(str(exc))
    world.comm.barrier()  # rank 1 skipped the shm barrier but meets rank 0 here (gloo)
    out.append(time.monotonic() - start)
    shm.close()
    meshwise.shutdown()
    return out


def test_mismatched_collectives_and_a_silent_peer_raise_named_errors():
    results = spawn(_mismatch_and_timeout, 2, timeout=100)
    for rank in (0, 1):
        assert f"rank {rank}" in results[rank][0] and "different collective" in results[rank][0]
    assert "rank 0 · barrier" in results[0][1] and "no progress within 2 s" in results[0][1]
    assert results[0][2] < 10


def _one_rank_leaves_early():
    world = meshwise.init("gloo", timeout=60)
    shm = ShmCommunicator.from_process_group(None, timeout=60)
    shm.all_reduce(torch.ones(8))  # both finish this call; rank 0 may close before rank 1 returns
    outcome = None
    if world.rank == 1:
        shm.close()  # leaves, but stays alive (as a rank inside MPI_Finalize does)
        time.sleep(6)
    else:
        start = time.monotonic()
        try:
            shm.all_reduce(torch.ones(8))
        except CommError as exc:
            outcome = type(exc).__name__, str(exc), time.monotonic() - start
        shm.close()
    world.comm.barrier()
    meshwise.shutdown()
    return outcome


def test_a_peer_that_closed_fails_the_waiting_rank_at_once():
    kind, message, seconds = spawn(_one_rank_leaves_early, 2, timeout=100)[0]
    assert kind == "PeerFailureError"
    assert "rank 1 closed the communicator" in message and "rank 0 · all_reduce" in message
    assert seconds < 3  # not the 60 s timeout


def _too_little_space():
    meshwise.init("gloo", timeout=30)
    refused = None
    try:
        ShmCommunicator.from_process_group(None, timeout=10, free_space=lambda path: 100_000)
    except CommError as exc:
        refused = type(exc).__name__, str(exc)
    # 5 MiB free: too little for two default 8 MiB segments, enough once the chunks shrink
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shm = ShmCommunicator.from_process_group(None, timeout=10, free_space=lambda path: 5 * 2**20)
    x = torch.arange(2**20, dtype=torch.float32)  # 4 MiB: streamed through the smaller regions
    shm.all_reduce(x)
    streamed = bool(torch.equal(x, torch.arange(2**20, dtype=torch.float32) * 2))
    fits = 2 * shm.layout.total_bytes <= 5 * 2**20
    shm.close()
    meshwise.shutdown()
    return refused, [str(w.message) for w in caught], streamed and fits


def test_insufficient_dev_shm_is_a_clear_error_on_every_rank_and_a_tight_one_shrinks_chunks():
    results = spawn(_too_little_space, 2, timeout=60)
    assert all(refused is not None for refused, _, _ in results), "0.1 MiB of /dev/shm was accepted"
    for (kind, message), _, _ in results:
        assert kind in ("ShmSpaceError", "CommError")
        assert "/dev/shm has 0.1 MiB free" in message and "need at least" in message
        assert "--shm-size" in message
    assert "rank 0 could not size" in results[1][0][1]
    warned = [w for w in results[0][1] if "shm segments shrank" in w]
    assert warned and "--shm-size" in warned[0]  # rank 0 says how to get full speed back
    assert [ok for _, _, ok in results] == [True, True]


@pytest.mark.parametrize(
    ("total", "cap"),
    [(0, 64), (5, 64), (64, 64), (65, 64), (4 << 18, 3 << 18), (16 << 18, 3 << 18), (97, 16)],
)
def test_messages_are_cut_into_the_fewest_nearly_equal_chunks(total, cap):
    chunks = chunks_of(total, cap)
    lengths = [min(chunks.step, total - start) for start in chunks]
    assert sum(lengths) == total and all(0 < n <= cap for n in lengths)
    assert len(lengths) == -(-total // cap)  # no more chunks than the region forces
    # equal up to the 16-element rounding: 4 MiB over 3 MiB regions is 2 + 2 MiB, not 3 + 1
    assert not lengths or max(lengths) - min(lengths) <= 16 * len(lengths)


def test_layout_planning_shrinks_chunks_then_refuses():
    full = Layout.for_segment(4, 8 * 2**20)
    layout, warning = plan_layout(4, 8 * 2**20, 10 * 2**30)
    assert layout == full and warning is None
    layout, warning = plan_layout(4, 8 * 2**20, 8 * 2**20)  # fits only with smaller chunks
    assert 4 * layout.total_bytes <= 8 * 2**20 < 4 * full.total_bytes
    assert warning is not None and "--shm-size" in warning
    with pytest.raises(ShmSpaceError, match=r"need at least .* MiB .*--shm-size"):
        plan_layout(4, 8 * 2**20, 4 * MIN_REGION_BYTES)
    with pytest.raises(ValueError, match="at least 65536"):
        plan_layout(2, 1000, 2**30)


def test_unvalidated_memory_models_are_refused_and_auto_falls_back_to_gloo(monkeypatch):
    check_memory_model("x86_64")
    with pytest.raises(CommError, match=r"x86-64 .*aarch64.*gloo"):
        check_memory_model("aarch64", "linux")
    with pytest.raises(CommError, match=r"needs Linux .*darwin.*gloo"):
        check_memory_model("x86_64", "darwin")
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, 4, single_host=True) == "shm"
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert resolve_backend("auto", cpu, 4, single_host=True) == "gloo"


def _auto():
    world = meshwise.init(timeout=30)
    x = torch.tensor([world.rank + 1.0])
    world.comm.all_reduce(x)
    backend = world.backend, type(world.comm.inner).__name__  # init hands out the flight recorder's wrapper
    meshwise.shutdown()
    shown = [line for line in render(collect()).splitlines() if line.startswith("auto")]
    return backend, x.item(), shown


def test_auto_picks_shm_for_cpu_ranks_on_one_host_and_info_shows_it():
    for backend, total, shown in spawn(_auto, 2, timeout=60):
        assert (backend, total) == (("shm", "ShmCommunicator"), 3.0)
        assert shown == ["auto        backend shm on cpu"]
