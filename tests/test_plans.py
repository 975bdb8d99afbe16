"""Collective plans checked without any process: :mod:`meshwise.comm.algorithms.simulate` runs every
rank's plan with the executor's rules on symbolic data — each element is a vector counting how often every
rank's contribution is in it — and proves that nothing deadlocks, every send meets a receive of the same
size, every element ends with each rank's contribution exactly once, and the step counts are the cost
model's α coefficients."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from meshwise.comm.algorithms import Send, build_plan
from meshwise.comm.algorithms import tree as tree_mod
from meshwise.comm.algorithms.plan import even_bounds, prefix
from meshwise.comm.algorithms.registry import REGISTRY, coefficients
from meshwise.comm.algorithms.simulate import one_hot, simulate, unknown

WORLDS = range(1, 10)


@pytest.mark.parametrize(
    "algo,pieces", [("ring", 1), ("ring", 3), ("rd", 1), ("rhd", 1), ("tree", 1), ("linear", 1)]
)
def test_all_reduce_contains_every_rank_exactly_once(algo, pieces):
    for p in WORLDS:
        for n in (1, 5, 13, 64):
            plans = [build_plan("all_reduce", algo, r, p, (n,), pieces=pieces) for r in range(p)]
            out = simulate(plans, [{"data": one_hot(r, p, n)} for r in range(p)])
            for r in range(p):
                np.testing.assert_array_equal(
                    out[r]["data"], np.ones((n, p)), err_msg=f"{algo} p={p} n={n} r={r}"
                )


def uneven(p: int, base: int) -> list[int]:
    return [(base * (r + 3)) % 7 + (r % 2) for r in range(p)]


@pytest.mark.parametrize("algo", ["ring", "rhd", "linear"])
def test_reduce_scatter_leaves_each_rank_its_fully_reduced_slot(algo):
    for p in WORLDS:
        for counts in ([4] * p, uneven(p, 3)):
            offsets = prefix(counts)
            plans = [build_plan("reduce_scatter", algo, r, p, tuple(counts), pieces=2) for r in range(p)]
            out = simulate(plans, [{"data": one_hot(r, p, offsets[-1])} for r in range(p)])
            for r in range(p):
                mine = out[r]["data"][offsets[r] : offsets[r + 1]]
                np.testing.assert_array_equal(mine, np.ones((counts[r], p)), err_msg=f"{algo} p={p} r={r}")


@pytest.mark.parametrize("algo", ["ring", "rd", "linear"])
def test_all_gather_places_every_slot(algo):
    for p in WORLDS:
        for counts in ([3] * p, uneven(p, 2)):
            offsets = prefix(counts)
            start = []
            for r in range(p):
                data = unknown(offsets[-1], p)
                data[offsets[r] : offsets[r + 1]] = one_hot(r, p, counts[r])
                start.append({"data": data})
            plans = [build_plan("all_gather", algo, r, p, tuple(counts), pieces=2) for r in range(p)]
            out = simulate(plans, start)
            want = np.concatenate([one_hot(s, p, counts[s]) for s in range(p)])
            for r in range(p):
                np.testing.assert_array_equal(out[r]["data"], want, err_msg=f"{algo} p={p} r={r}")


@pytest.mark.parametrize("algo", ["tree", "linear"])
def test_broadcast_and_reduce_from_every_root(algo):
    for p in WORLDS:
        for root in range(p):
            plans = [build_plan("broadcast", algo, r, p, (6,), root) for r in range(p)]
            start = [{"data": one_hot(root, p, 6) if r == root else unknown(6, p)} for r in range(p)]
            for r, bufs in enumerate(simulate(plans, start)):
                np.testing.assert_array_equal(
                    bufs["data"], one_hot(root, p, 6), err_msg=f"p={p} root={root} r={r}"
                )
            plans = [build_plan("reduce", algo, r, p, (6,), root) for r in range(p)]
            out = simulate(plans, [{"data": one_hot(r, p, 6)} for r in range(p)])
            np.testing.assert_array_equal(out[root]["data"], np.ones((6, p)))


def test_tree_scatter_and_gather_move_uneven_slots_through_subtrees():
    for p in WORLDS:
        for root in range(p):
            counts_real = uneven(p, 5)
            order = tree_mod.relative_order(p, root)
            rel = [counts_real[r] for r in order]
            offsets = prefix(rel)
            start = []
            for r in range(p):
                v = (r - root) % p
                width = tree_mod.subtree_size(r, p, root)
                size = offsets[v + width] - offsets[v]
                if r == root:
                    start.append({"data": np.concatenate([one_hot(order[i], p, rel[i]) for i in range(p)])})
                else:
                    start.append({"data": unknown(size, p)})
            plans = [build_plan("scatter", "tree", r, p, tuple(rel), root) for r in range(p)]
            out = simulate(plans, start)
            for r in range(p):
                np.testing.assert_array_equal(out[r]["data"][: counts_real[r]], one_hot(r, p, counts_real[r]))
            gathered = []
            for r in range(p):
                data = start[r]["data"].copy() if r != root else unknown(offsets[-1], p)
                data[: counts_real[r]] = one_hot(r, p, counts_real[r])  # own slot first (root: v = 0)
                gathered.append({"data": data})
            plans = [build_plan("gather", "tree", r, p, tuple(rel), root) for r in range(p)]
            out = simulate(plans, gathered)
            want = np.concatenate([one_hot(order[i], p, rel[i]) for i in range(p)])
            np.testing.assert_array_equal(out[root]["data"], want, err_msg=f"p={p} root={root}")


@pytest.mark.parametrize("pairwise", [True, False])
def test_all_to_all_delivers_each_pair_once(pairwise):
    algo = "pairwise" if pairwise else "linear"
    for p in WORLDS:
        send = [[(i + j) % 3 + 1 for j in range(p)] for i in range(p)]  # rank i -> rank j
        plans, start = [], []
        for r in range(p):
            recv = [send[i][r] for i in range(p)]
            plans.append(build_plan("all_to_all", algo, r, p, tuple(send[r]) + tuple(recv)))
            start.append(
                {
                    "in": np.concatenate([one_hot(r, p, send[r][j]) * (j + 1) for j in range(p)]),
                    "out": unknown(sum(recv), p),
                }
            )
        out = simulate(plans, start)
        for r in range(p):
            want = np.concatenate([one_hot(i, p, send[i][r]) * (r + 1) for i in range(p)])
            np.testing.assert_array_equal(out[r]["out"], want)
        if pairwise and p > 1:
            assert plans[0].steps == p - 1


def lg(p: int) -> int:
    return (p - 1).bit_length()


def test_step_counts_match_textbook_and_cost_model():
    for p in range(2, 10):
        p2 = 1 << (p.bit_length() - 1)
        fold = 0 if p == p2 else 2
        expected = {
            ("all_reduce", "ring"): 2 * (p - 1),
            ("all_reduce", "rd"): int(math.log2(p2)) + fold,
            ("all_reduce", "rhd"): 2 * int(math.log2(p2)) + fold,
            ("all_reduce", "tree"): 2 * lg(p),
            ("reduce_scatter", "ring"): p - 1,
            ("reduce_scatter", "rhd"): int(math.log2(p2)) + fold,
            ("all_gather", "ring"): p - 1,
            ("all_gather", "rd"): int(math.log2(p2)) + fold,
            ("broadcast", "tree"): lg(p),
            ("reduce", "tree"): lg(p),
            ("all_to_all", "pairwise"): p - 1,
        }
        for (collective, algo), steps in expected.items():
            sizes = (16,) if collective in ("all_reduce", "broadcast", "reduce") else (4,) * p
            if collective == "all_to_all":
                sizes = (4,) * 2 * p
            plan_steps = max(build_plan(collective, algo, r, p, sizes).steps for r in range(p))
            assert plan_steps == steps, f"{collective}/{algo} p={p}: plan has {plan_steps} steps, not {steps}"
            alpha = coefficients(collective, algo, 64, p)[0]
            assert alpha == steps, f"{collective}/{algo} p={p}: cost model counts {alpha} latencies"
        # tree scatter/gather: the sizes travel through the same tree first, so the model counts 2·lg p
        for collective in ("scatter", "gather"):
            data = max(build_plan(collective, "tree", r, p, (4,) * p, 1).steps for r in range(p))
            sizes = tree_mod.counts_plan_scatter if collective == "scatter" else tree_mod.counts_plan_gather
            size_steps = max(sizes(r, p, 1).steps for r in range(p))
            assert data == size_steps == lg(p)
            assert coefficients(collective, "tree", 64, p)[0] == data + size_steps
        # linear: one round, but the busiest rank posts p−1 messages, which is what the model charges
        for collective in ("all_reduce", "broadcast", "all_gather"):
            sizes = (16,) if collective != "all_gather" else (4,) * p
            plans = [build_plan(collective, "linear", r, p, sizes) for r in range(p)]
            assert max(plan.steps for plan in plans) == 1
            busiest = max(sum(isinstance(op, Send) for op in plan.ops) for plan in plans)
            assert busiest == p - 1 == coefficients(collective, "linear", 64, p)[0]


def test_exchange_steps_match_the_cost_models_sigma_coefficient():
    # σ counts the rounds where a rank both sends and receives; trees and rooted plans are one-way
    for p in range(2, 10):
        for algo, entry in REGISTRY.items():
            if algo in ("native", "hierarchical"):
                continue
            for collective in entry.implements:
                sizes = (16,) if collective in ("all_reduce", "broadcast", "reduce") else (4,) * p
                if collective == "all_to_all":
                    sizes = (4,) * 2 * p
                plans = [build_plan(collective, algo, r, p, sizes) for r in range(p)]
                busiest = max(plan.exchange_steps for plan in plans)
                sigma = coefficients(collective, algo, 64, p)[3]
                assert busiest == sigma, f"{collective}/{algo} p={p}: plans {busiest}, model {sigma}"


def test_ring_pipelining_splits_blocks_without_changing_the_step_count():
    plan = build_plan("all_reduce", "ring", 0, 4, (4000,), pieces=8)
    sends = [op for op in plan.ops if isinstance(op, Send)]
    assert len(sends) == 8 * 2 * 3 and plan.steps == 6
    # a reduced segment is forwarded before the next segment of the same block is reduced
    kinds = [type(op).__name__ for op in plan.ops]
    first_reduce = kinds.index("Reduce")
    assert kinds[first_reduce + 1] == "Send"


def test_even_bounds_cover_everything():
    for total in range(0, 20):
        for parts in range(1, 7):
            b = even_bounds(total, parts)
            assert b[0] == 0 and b[-1] == total and all(x <= y for x, y in itertools.pairwise(b))
            assert (
                max(y - x for x, y in itertools.pairwise(b)) - min(y - x for x, y in itertools.pairwise(b))
                <= 1
            )


def test_simulator_reports_deadlocks_and_size_mismatches():
    from meshwise.comm.algorithms.plan import PlanBuilder, Region
    from meshwise.comm.algorithms.simulate import PlanDeadlock, PlanMismatch

    def plan(rank: int, recv_first: bool, length: int):
        b = PlanBuilder("all_reduce", "test", rank, 2)
        b.need("tmp", length)
        ops = [
            lambda: b.recv(1 - rank, Region("tmp", 0, length), 0),
            lambda: b.send(1 - rank, Region("data", 0, 2), 0),
        ]
        for op in ops if recv_first else reversed(ops):
            op()
        b.fence()
        b.reduce(Region("data", 0, 2), Region("tmp", 0, 2))
        return b.build()

    start = [{"data": one_hot(r, 2, 2)} for r in range(2)]
    out = simulate([plan(0, True, 2), plan(1, True, 2)], start)  # receives are posted without blocking
    assert all(np.array_equal(o["data"], np.ones((2, 2))) for o in out)
    with pytest.raises(PlanMismatch, match="rank 0 sends 2 elements, rank 1 expects 3"):
        simulate([plan(0, False, 2), plan(1, False, 3)], start)
    lonely = PlanBuilder("broadcast", "test", 0, 2)
    lonely.recv(1, Region("data", 0, 2), 0)
    lonely.reduce(Region("data", 0, 2), Region("data", 0, 2))
    silent = PlanBuilder("broadcast", "test", 1, 2).build()
    with pytest.raises(PlanDeadlock, match="program counters"):
        simulate([lonely.build(), silent], start)
