"""Debug mode: mismatched collectives are named on every rank within seconds, with both call sites."""

import re
import time

import pytest
import torch

import meshwise
from meshwise.comm.api import CollectiveMismatchError
from meshwise.comm.debug import DebugChecker, default_store
from meshwise.comm.factory import create_communicator
from meshwise.comm.fingerprint import Fingerprint, find_mismatch
from meshwise.comm.instrumented import InstrumentedCommunicator
from meshwise.runtime.spawn import spawn


def _fp(op, dtype="float32", count=8, site="a.py:1", **kw):
    return Fingerprint(seq=3, op=op, dtype=dtype, shape=(count,), count=count, site=site, **kw)


# ---------------------------------------------------------------- the comparison, as plain data
def test_matching_calls_pass_even_from_different_lines_and_shapes():
    a = _fp("all_reduce", reduce_op="sum", site="a.py:1")
    b = Fingerprint(3, "all_reduce", "float32", (2, 4), 8, reduce_op="sum", site="b.py:9")
    assert find_mismatch([a, b, a]) is None


def test_the_odd_rank_is_named_with_both_calls_and_sites():
    ar = _fp("all_reduce", count=1024, reduce_op="sum", site="train.py:42")
    bc = _fp("broadcast", count=10, root=0, site="train.py:57")
    message = find_mismatch([bc, ar, bc, bc])
    assert message == (
        "rank 1 called all_reduce(float32[1024], sum) at train.py:42 while ranks 0,2,3 called "
        "broadcast(float32[10], root=0) at train.py:57 (collective #3)"
    )


@pytest.mark.parametrize(
    "other",
    [
        _fp("all_reduce", dtype="float64", reduce_op="sum"),
        _fp("all_reduce", count=9, reduce_op="sum"),
        _fp("all_reduce", reduce_op="max"),
    ],
)
def test_dtype_count_and_reduce_op_must_agree(other):
    assert find_mismatch([_fp("all_reduce", reduce_op="sum"), other]) is not None


def test_all_to_all_counts_must_pair_up():
    def a2a(sends, recvs, site):
        return Fingerprint(1, "all_to_all", "float32", slots_in=sends, slots_out=recvs, site=site)

    assert find_mismatch([a2a((1, 2), (1, 3), "x.py:1"), a2a((3, 4), (2, 4), "x.py:2")]) is None
    message = find_mismatch([a2a((1, 2), (1, 3), "x.py:1"), a2a((3, 4), (5, 4), "x.py:2")])
    assert message == (
        "in all_to_all (collective #1) rank 0 sends 2 elements to rank 1 (at x.py:1) "
        "but rank 1 expects 5 from rank 0 (at x.py:2)"
    )


def test_scatter_slot_must_match_the_receivers_tensor():
    root = Fingerprint(1, "scatter", "float32", (2,), 2, slots_in=(2, 3), root=0, site="r.py:1")
    leaf = Fingerprint(1, "scatter", "float32", (4,), 4, root=0, site="r.py:2")
    assert "rank 0 sends 3 elements to rank 1" in find_mismatch([root, leaf])


def test_fingerprint_survives_json():
    fp = _fp("all_gather", slots_out=(1, 2), algorithm="ring")
    assert Fingerprint.from_json(fp.to_json()) == fp


# ---------------------------------------------------------------- the programs that mismatch on purpose
def _op(comm, rank):
    if rank == 1:
        comm.broadcast(torch.ones(10), root=0)
    else:
        comm.all_reduce(torch.ones(10))


def _dtype(comm, rank):
    comm.all_reduce(torch.ones(10, dtype=torch.float64 if rank == 1 else torch.float32))


def _shape(comm, rank):
    comm.all_reduce(torch.ones(5 if rank == 1 else 10))


def _root(comm, rank):
    comm.broadcast(torch.ones(10), root=1 if rank == 1 else 0)


def _order(comm, rank):
    if rank == 1:
        comm.all_reduce(torch.ones(6))
        comm.all_reduce(torch.ones(4))
    else:
        comm.all_reduce(torch.ones(4))
        comm.all_reduce(torch.ones(6))


def _skip(comm, rank):
    comm.all_reduce(torch.ones(4))
    if rank != 1:
        comm.all_reduce(torch.ones(4))
    comm.close()


def _extra(comm, rank):
    comm.all_reduce(torch.ones(4))
    if rank == 1:
        comm.all_reduce(torch.ones(4))
    comm.close()


SCENARIOS = {"op": _op, "dtype": _dtype, "shape": _shape, "root": _root, "order": _order}
SCENARIOS |= {"skip": _skip, "extra": _extra}


def _mismatch_programs(backend):
    world = meshwise.init("gloo", timeout=30)
    outcomes = {}
    try:
        for name, program in SCENARIOS.items():
            inner = create_communicator(backend, timeout=30)
            checker = DebugChecker(default_store(), f"test/{name}", world.rank, world.world_size, 30)
            comm = InstrumentedCommunicator(inner, checker=checker)
            started = time.monotonic()
            try:
                program(comm, world.rank)
                outcomes[name] = ("no error", "", time.monotonic() - started)
            except CollectiveMismatchError as exc:
                outcomes[name] = (type(exc).__name__, str(exc), time.monotonic() - started)
            finally:
                comm.close()
        # and a correct program gives the same numbers as without debug mode
        checker = DebugChecker(default_store(), "test/ok", world.rank, world.world_size, 30)
        comm = InstrumentedCommunicator(create_communicator(backend, timeout=30), checker=checker)
        values = torch.full((6,), float(world.rank + 1))
        comm.all_reduce(values)
        gathered = torch.zeros(2 * world.world_size)
        comm.all_gather(gathered, torch.full((2,), float(world.rank)))
        comm.close()
        outcomes["correct"] = (values.tolist(), gathered.tolist())
    finally:
        meshwise.shutdown()
    return outcomes


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_every_rank_names_the_mismatch_within_seconds(backend):
    results = spawn(_mismatch_programs, 3, args=(backend,), timeout=110)
    for rank, outcomes in enumerate(results):
        assert outcomes.pop("correct") == ([6.0] * 6, [0.0, 0.0, 1.0, 1.0, 2.0, 2.0])
        for name, (kind, message, seconds) in outcomes.items():
            assert kind == "CollectiveMismatchError", (rank, name, message)
            assert seconds < 10, (rank, name, seconds)
            sites = re.findall(r"test_debug_mode\.py:(\d+)", message)
            assert len(sites) == 2, (name, message)  # both call sites, on every rank
            assert name in ("dtype", "shape", "root") or sites[0] != sites[1], (name, message)
            assert "rank 1 called" in message and "ranks 0,2 called" in message, (name, message)
            # every rank raises the same explanation
            assert message.split("] ", 1)[1] == results[0][name][1].split("] ", 1)[1]
    messages = {name: results[0][name][1] for name in SCENARIOS}
    assert "broadcast(float32[10], root=0)" in messages["op"]
    assert "all_reduce(float32[10], sum)" in messages["op"]
    assert "float64[10]" in messages["dtype"]
    assert "float32[5]" in messages["shape"]
    assert "root=1" in messages["root"]
    assert "float32[6]" in messages["order"] and "(collective #1)" in messages["order"]
    assert "rank 1 called close()" in messages["skip"]
    assert "ranks 0,2 called close()" in messages["extra"]


# ---------------------------------------------------------------- numbering under meshwise.init's own setup
def _first_collective_on_a_mesh():
    from meshwise.comm.mesh import MeshShape

    world = meshwise.init("gloo", timeout=30, debug=True, mesh=MeshShape(dp=2, tp=2))
    try:
        comm = world.comm
        setup = [r.fingerprint for r in comm._setup.recorder.records]
        try:
            if world.rank == 1:
                comm.broadcast(torch.ones(10), root=0)
            else:
                comm.all_reduce(torch.ones(10))
            message = "no error"
        except CollectiveMismatchError as exc:
            message = str(exc)
        user = [(r.fingerprint.seq, r.fingerprint.op) for r in comm.recorder.records]
        return [(fp.seq, fp.op, fp.ranks) for fp in setup], user, message
    finally:
        meshwise.shutdown()


def test_the_users_first_collective_is_number_one_after_the_mesh_is_split():
    results = spawn(_first_collective_on_a_mesh, 4, timeout=60)
    for rank, (setup, user, message) in enumerate(results):
        # init split dp and tp (two groups each, numbered apart); the one-rank groups (pp, ep, cp) are made
        # by their rank alone, unnumbered
        assert [s for s in setup if s[0] > 0] == [
            (1, "split", (0, 2)),
            (2, "split", (1, 3)),
            (3, "split", (0, 1)),
            (4, "split", (2, 3)),
        ]
        assert [s for s in setup if s[0] == 0] == [(0, "split", (rank,))]
        assert user[0][0] == 1, user
        assert "(collective #1)" in message and "rank 1 called broadcast" in message, message
