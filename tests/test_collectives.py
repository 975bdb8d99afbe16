"""Every algorithm against native torch.distributed (gloo) on 1–5 ranks, the seeds' tables, and errors.

One spawn per world size runs the whole matrix inside the ranks (every covered collective × dtype × op,
in and out of place, even and uneven, every root) and returns the mismatch descriptions, so a failure
message says exactly which case differed on which rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import pytest
import torch

import meshwise
from collective_matrix import COLLECTIVES, check_collectives
from conftest import joined
from meshwise.comm import CommError
from meshwise.comm.algorithms import ALGORITHMS, with_algorithm
from meshwise.comm.algorithms.registry import implemented
from meshwise.comm.cost import Calibration, LinkParams
from meshwise.comm.shm import ShmCommunicator
from meshwise.runtime.spawn import SpawnError, spawn

ALGOS = [a for a in ALGORITHMS if a != "native"]
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
    "int64": torch.int64,
}
SEGMENT = 64  # bytes: forces the pipelined (segmented) ring paths on test-sized messages


def node_map(world_size: int) -> list[int]:
    """Two nodes when the world is even, else one rank per node (both are valid hierarchies)."""
    return (
        [2 * r // world_size for r in range(world_size)] if world_size % 2 == 0 else list(range(world_size))
    )


#: For ``auto``: a backend whose own collectives are predicted hopeless, so that auto's choices land on
#: our algorithms (which one depends on collective, size and world) and the matrix exercises its dispatch.
SLOW_NATIVE = Calibration(
    LinkParams(1e-5, 1e-9, 1e-9), LinkParams(1e-4, 1e-8, 1e-9), LinkParams(1.0, 1.0, 1.0)
)


def _algorithm(comm, algo: str, calibration: Calibration | None = None):
    nm = node_map(comm.world_size) if algo in ("hierarchical", "auto") else None
    if algo == "auto" and calibration is None:
        calibration = SLOW_NATIVE
    return with_algorithm(comm, algo, node_map=nm, calibration=calibration, segment_bytes=SEGMENT)


GROUPS = {
    "bandwidth": ("ring", "rd", "rhd"),
    "rooted": ("tree", "linear", "pairwise"),
    "composed": ("hierarchical", "auto"),
}


def _matrix(
    groups: Mapping[str, Sequence[str]], dtype_names: list[str], sizes: list[int], over_shm: bool = False
) -> dict[str, list[str]]:
    """The matrix for each group's algorithms over gloo's point-to-point (or shared-memory mailboxes of
    4 KiB, so larger messages stream in chunks), against native gloo; the mismatches by group."""
    with joined("gloo", timeout=30) as world:
        native, failures = world.comm, {}
        base = native
        if over_shm:
            base = ShmCommunicator.from_process_group(None, timeout=30, segment_bytes=64 << 10)
        for group, algos in groups.items():
            failures[group] = []
            for algo in algos:
                covered = COLLECTIVES if algo in ("auto", "linear") else implemented(algo)
                comm = _algorithm(base, algo)
                found = check_collectives(
                    comm, native, dtypes=[DTYPES[d] for d in dtype_names], sizes=sizes, collectives=covered
                )
                comm.close()
                failures[group] += [f"{algo} over {base.backend}: {f}" for f in found]
        base.close()
    return failures


def _mismatches(per_rank: list[dict[str, list[str]]], group: str) -> list[str]:
    return [f for rank in per_rank for f in rank[group]]


@pytest.fixture(scope="module")
def matrix_by_world() -> Callable[[int], list[dict[str, list[str]]]]:
    """Every group's matrix on a world size, run in one spawn the first time a test asks for that size
    (one rendezvous and one set of ranks instead of one per group); each group's test then asserts on
    its own mismatches, so a failure still names the group and world size."""
    done: dict[int, list[dict[str, list[str]]] | SpawnError] = {}

    def per_rank(world_size: int) -> list[dict[str, list[str]]]:
        if world_size not in done:
            # every dtype up to 4 ranks; the 5-rank (folding) world keeps one float, one half and one integer
            dtypes = list(DTYPES) if world_size <= 4 else ["float32", "bfloat16", "int64"]
            try:
                done[world_size] = spawn(_matrix, world_size, args=(GROUPS, dtypes, [1, 13]), timeout=110)
            except SpawnError as exc:  # kept: the size's other groups fail with it, not after a rerun
                done[world_size] = exc
        result = done[world_size]
        if isinstance(result, SpawnError):
            raise result
        return result

    return per_rank


@pytest.mark.slow
@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_every_algorithm_matches_native(matrix_by_world, world_size, group):
    assert _mismatches(matrix_by_world(world_size), group) == []


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [3, 4])
def test_every_algorithm_matches_native_on_segmented_messages(world_size):
    failures = spawn(_matrix, world_size, args=({"all": ALGOS}, ["float32", "int64"], [300]), timeout=110)
    assert _mismatches(failures, "all") == []


@pytest.mark.slow
def test_every_algorithm_over_shm_point_to_point_matches_native():
    """The plans' many in-flight isend/irecv per pair through shared-memory mailboxes, in posting order;
    700 float64 (5.6 kB) per slot stream through the 4 KiB mailboxes."""
    failures = spawn(_matrix, 4, args=({"all": ALGOS}, ["float64"], [1, 700], True), timeout=110)
    assert _mismatches(failures, "all") == []


def _random_floats() -> dict[str, float]:
    """Non-exact float inputs: every algorithm within a tight tolerance of native, and bit-identical on
    all ranks (so replicas never drift apart)."""
    with joined("gloo", timeout=30) as world:
        native, errors = world.comm, {}
        gen = torch.Generator().manual_seed(world.rank)
        x = torch.randn(5003, generator=gen)
        want = x.clone()
        native.all_reduce(want)
        for algo in ALGOS:
            got = x.clone()
            comm = _algorithm(native, algo)
            comm.all_reduce(got)
            comm.close()
            errors[algo] = float(((got - want).abs() / want.abs().clamp_min(1e-3)).max())
            everyone = torch.empty(world.world_size * got.numel())
            native.all_gather(everyone, got)
            errors[algo + " replicas differ"] = float((everyone.view(world.world_size, -1) != got).sum())
    return errors


def test_random_floats_are_close_to_native_and_identical_across_ranks():
    for rank_errors in spawn(_random_floats, 3, timeout=90):
        for name, err in rank_errors.items():
            limit = 0.0 if "replicas" in name else 1e-4
            assert err <= limit, f"{name}: {err}"


def _seed_tables(backend: str, algo: str) -> dict:
    with joined(backend, timeout=30) as world:
        comm, rank = _algorithm(world.comm, algo), world.rank
        out = {}
        x = torch.tensor([float(rank + 1)])  # Exercise 0: GPU0..3 = [1],[2],[3],[4]
        reduced = x.clone()
        comm.reduce(reduced, root=0)
        out["ex0_reduce"] = reduced.tolist()
        summed = x.clone()
        comm.all_reduce(summed)
        out["ex0_all_reduce"] = summed.tolist()
        gathered = torch.empty(4)
        comm.all_gather(gathered, x)
        out["ex0_all_gather"] = gathered.tolist()
        abcd = torch.tensor([65, 66, 67, 68])  # A B C D
        letters = abcd if rank == 0 else torch.zeros(4, dtype=torch.int64)
        comm.broadcast(letters, root=0)
        out["broadcast"] = letters.tolist()
        shard = torch.empty(1, dtype=torch.int64)
        comm.scatter(shard, list(torch.tensor([65, 66, 67, 68]).split(1)) if rank == 0 else None, root=0)
        out["scatter"] = shard.tolist()
        full = [torch.empty(1, dtype=torch.int64) for _ in range(4)] if rank == 0 else None
        comm.gather(shard, full, root=0)
        out["gather"] = [t.item() for t in full] if full else None
        everyone = torch.empty(4, dtype=torch.int64)
        comm.all_gather(everyone, shard)  # AllGather table: [A] [B] [C] [D] → [A B C D] everywhere
        out["all_gather"] = everyone.tolist()
        row = torch.arange(rank + 1, rank + 4, dtype=torch.int64)  # rank r holds [r+1, r+2, r+3]
        red = row.clone()
        comm.reduce(red, root=0)
        out["reduce"] = red.tolist()
        comm.all_reduce(row)
        out["all_reduce"] = row.tolist()
        piece = torch.empty(1, dtype=torch.int64)
        comm.reduce_scatter(piece, torch.arange(rank + 1, rank + 5, dtype=torch.int64))  # [r+1 … r+4]
        out["reduce_scatter"] = piece.tolist()
        # CS336 lecture: all_reduce of [0 1 2 3] + r, then reduce_scatter of the same inputs and all_gather of
        # its output give [6 10 14 18] both ways — "all-reduce = reduce-scatter + all-gather", literally.
        lecture = torch.tensor([0.0, 1, 2, 3]) + rank
        direct = lecture.clone()
        comm.all_reduce(direct)
        part = torch.empty(1)
        comm.reduce_scatter(part, lecture)
        composed = torch.empty(4)
        comm.all_gather(composed, part)
        out["lecture"] = (direct.tolist(), part.tolist(), composed.tolist())
        # the same identity on non-exact floats
        gen = torch.Generator().manual_seed(rank)
        v = torch.randn(4 * 1001, generator=gen)
        direct = v.clone()
        comm.all_reduce(direct)
        part = torch.empty(1001)
        comm.reduce_scatter(part, v)
        composed = torch.empty(4 * 1001)
        comm.all_gather(composed, part)
        out["rs_ag_max_diff"] = float((direct - composed).abs().max())
        out["rs_ag_bitwise"] = bool(torch.equal(direct, composed))
        if comm is not world.comm:
            comm.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend,algo",
    [("gloo", "native"), ("shm", "native"), ("gloo", "ring"), ("gloo", "tree"), ("gloo", "rhd"),
     ("gloo", "auto"), ("shm", "rd")],
)  # fmt: skip
def test_seed_tables_literally(backend, algo):
    results = spawn(_seed_tables, 4, args=(backend, algo), timeout=90)
    assert results[0]["ex0_reduce"] == [10.0]
    assert [r["ex0_reduce"] for r in results[1:]] == [[2.0], [3.0], [4.0]]  # non-roots keep their input
    for r in results:
        assert r["ex0_all_reduce"] == [10.0]
        assert r["ex0_all_gather"] == [1.0, 2.0, 3.0, 4.0]
        assert r["broadcast"] == [65, 66, 67, 68]
        assert r["all_gather"] == [65, 66, 67, 68]
        assert r["all_reduce"] == [10, 14, 18]
        assert r["lecture"][0] == r["lecture"][2] == [6.0, 10.0, 14.0, 18.0]
        assert r["rs_ag_max_diff"] < 1e-5
    assert [r["scatter"] for r in results] == [[65], [66], [67], [68]]
    assert results[0]["gather"] == [65, 66, 67, 68]
    assert results[0]["reduce"] == [10, 14, 18]
    assert [r["reduce_scatter"] for r in results] == [[10], [14], [18], [22]]
    assert [r["lecture"][1] for r in results] == [[6.0], [10.0], [14.0], [18.0]]
    if algo == "ring":  # ring all_reduce *is* ring reduce-scatter followed by ring all-gather
        assert all(r["rs_ag_bitwise"] for r in results)


def _mismatch(backend: str, algo: str, what: str) -> str:
    world = meshwise.init(backend, timeout=5)
    comm = with_algorithm(world.comm, algo, check_consistency=backend == "gloo")
    if what == "size":
        x = torch.ones(4 if world.rank == 0 else 8)
    else:  # same byte count, so only a check of the dtype itself can notice
        x = torch.ones(4, dtype=torch.float32 if world.rank == 0 else torch.int32)
    try:
        comm.all_reduce(x)
    except CommError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize(
    "backend,algo,what",
    [("gloo", "ring", "size"), ("gloo", "rd", "dtype"), ("gloo", "native", "size"),
     ("gloo", "native", "dtype"), ("shm", "native", "size"), ("shm", "native", "dtype")],
)  # fmt: skip
def test_mismatched_ranks_fail_with_an_error_naming_rank_and_op(backend, algo, what):
    """gloo aborts the process on a size mismatch and reduces garbage on a dtype one, so over gloo the
    opt-in consistency check must catch both; shm's call signatures catch them without it."""
    results = spawn(_mismatch, 2, args=(backend, algo, what), timeout=60)
    for rank, message in enumerate(results):
        expected = (
            f"ranks disagree on {what}"
            if backend == "gloo"
            else f"rank {1 - rank} called a different collective"
        )
        assert message.startswith(f"CollectiveMismatchError: [rank {rank} · all_reduce] {expected}"), message


def _bad_ops() -> list[str]:
    with joined("gloo", timeout=10) as world:
        comm = _algorithm(world.comm, "rhd")
        errors = []
        for call in (
            lambda: comm.all_reduce(torch.ones(2, dtype=torch.int64), op="avg"),
            lambda: comm.all_reduce(torch.ones(2), op="xor"),
            lambda: comm.reduce_scatter(torch.empty(3), torch.ones(5)),
            lambda: comm.all_reduce(torch.ones(2, dtype=torch.uint8)),
            lambda: comm.broadcast(torch.ones(2, dtype=torch.complex64)),
            lambda: comm.all_gather(torch.empty(4), torch.ones(2, dtype=torch.float64)),
            lambda: comm.all_reduce(torch.ones(4)[::2]),
        ):
            try:
                call()
                errors.append("no error")
            except (TypeError, ValueError) as exc:
                errors.append(str(exc))
    return errors


def test_an_op_a_dtype_cannot_do_is_refused_before_communicating():
    errors = spawn(_bad_ops, 2, timeout=60)[0]
    assert "AVG is not defined for integer" in errors[0]
    assert "unknown reduce op 'xor'" in errors[1]
    assert "divisible by the world size 2" in errors[2]
    assert "dtype torch.uint8 is not supported" in errors[3]
    assert "dtype torch.complex64 is not supported" in errors[4]
    assert "mix dtypes" in errors[5]
    assert "must be contiguous" in errors[6]


def _numpy_arrays() -> list:
    import numpy as np

    world = meshwise.init("gloo", timeout=20)
    shm = ShmCommunicator.from_process_group(None, timeout=20)
    out = []
    for comm in (world.comm, with_algorithm(world.comm, "ring"), shm):
        summed = np.arange(4, dtype=np.float64) + world.rank
        comm.all_reduce(summed)  # in place: the result lands in the caller's array
        gathered = np.zeros((2, 3), dtype=np.float32)
        comm.all_gather(gathered, np.full(3, world.rank, dtype=np.float32))
        pieces = [np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64)]
        comm.all_to_all(pieces, [np.array([world.rank, k]) for k in range(2)])
        out.append((summed.tolist(), gathered.tolist(), [p.tolist() for p in pieces]))
    errors = []
    for bad in ([1.0, 2.0], np.broadcast_to(np.ones(1), (4,))):
        try:
            world.comm.all_reduce(bad)
        except (TypeError, ValueError) as exc:
            errors.append(str(exc))
    shm.close()
    meshwise.shutdown()
    return [out, errors]


def test_numpy_arrays_are_taken_as_tensors_and_other_objects_named():
    """A numpy array goes through torch.from_numpy (sharing memory, so in-place results land in it);
    a list is refused by what it is, not with an untrue dtype message."""
    (out, errors), _ = spawn(_numpy_arrays, 2, timeout=60)
    for summed, gathered, pieces in out:
        assert summed == [1.0, 3.0, 5.0, 7.0]
        assert gathered == [[0.0] * 3, [1.0] * 3]
        assert pieces == [[0, 0], [1, 0]]  # rank 0 receives slot 0 of every rank
    assert "tensor is a list, not a tensor; pass a torch.Tensor (or a numpy array" in errors[0]
    assert "read-only numpy array; pass array.copy()" in errors[1]


def test_unknown_algorithm_and_bad_arguments_are_refused():
    class Dummy:
        rank, world_size, timeout, backend = 0, 1, 1.0, "x"

    with pytest.raises(ValueError, match="unknown algorithm 'fastest'"):
        with_algorithm(Dummy(), "fastest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs node_map"):
        with_algorithm(Dummy(), "hierarchical")  # type: ignore[arg-type]
    base = Dummy()
    assert with_algorithm(base, "native") is base  # type: ignore[arg-type]


def _closed() -> list[str]:
    with joined("gloo", timeout=10) as world:
        comm = world.comm
        wrapper = with_algorithm(comm, "hierarchical", node_map=[0, 1])
        subgroups = [sub.base for sub in (wrapper.hierarchy.intra, wrapper.hierarchy.inter)]
        wrapper.close()
    errors = []
    for closed in (comm, *subgroups):
        assert closed.group is None  # no process group outlives the job (it would abort at exit)
        try:
            closed.all_reduce(torch.ones(2))
            errors.append("no error")
        except CommError as exc:
            errors.append(str(exc))
    return errors


def test_a_closed_communicator_releases_its_group_and_refuses_work():
    for errors in spawn(_closed, 2, timeout=60):
        assert len(errors) == 3 and all("the communicator is closed" in e for e in errors), errors


def _auto_choices() -> dict[str, list[str]]:
    with joined("gloo", timeout=30) as world:
        latency = Calibration(
            LinkParams(1e-3, 1e-12, 1e-12), LinkParams(1e-3, 1e-12, 1e-12), LinkParams(1e-3, 1e-12, 1e-12)
        )
        comm = with_algorithm(world.comm, "auto", calibration=latency)
        picks = [comm.choose("all_reduce", n) for n in (8, 1 << 26)]
        x = torch.full((1000,), float(world.rank))
        comm.all_reduce(x)
    return {"picks": picks, "sum": x.unique().tolist()}


def test_auto_follows_the_calibration():
    result = spawn(_auto_choices, 4, timeout=60)[0]
    assert result["picks"] == ["rd", "rd"]  # α-dominated link: fewest steps wins at every size
    assert result["sum"] == [6.0]
