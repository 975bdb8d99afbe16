"""``meshwise train gpt --zero 1|2|3 --ep N``: ZeRO × expert parallelism equals one process at every step.

Dense parameters are replicated over ``mesh.replicas`` (dp·ep) and ZeRO shards them there; each rank's
experts (E/ep of every layer) are replicated only over ``mesh.expert_replicas`` (dp) and ZeRO shards them
over those ranks, with their gradient divided by ep (:func:`~meshwise.train.gpt.parallelize.expert_replicas`).
The parity harness is tests/test_moe_ep_train.py's (the real trainer against a one-process MoE GPT built
from plain pieces, every step: loss, every parameter gathered over the replicas and ep, router
statistics; zero2·ep2·tp2 adds tensor parallelism, experts whole on every tp rank); tolerances are its
and tests/test_gpt_layouts.py's (fp32): loss 2e-5, parameters 5e-5 at lr 1e-3 (5 % of one Adam update)
— ZeRO and the all-to-alls only change the order of the sums. A zero3·ep2 checkpoint (each rank's flat
range, experts under their global names) resumes exactly as plain ep2 and as ZeRO-2 on one process, an
ep2 one as zero1·ep2.
"""

from __future__ import annotations

import re

import pytest

from gpt_reference import assert_resumed, resume_run
from meshwise.runtime.spawn import spawn
from meshwise.train.gpt.report import strategy_line
from test_moe_ep_train import LOSS_TOLERANCE, PARAM_TOLERANCE, _check, _compare, _config

#: row name → (ranks, flags of `meshwise train gpt`, ranks one expert's shards are spread over)
LAYOUTS: dict[str, tuple[int, dict, int]] = {
    "zero1·ep2": (2, {"zero": 1, "ep": 2}, 1),
    "zero2·ep2 capacity 1.0": (2, {"zero": 2, "ep": 2, "capacity_factor": 1.0}, 1),
    "zero3·ep2": (2, {"zero": 3, "ep": 2}, 1),
}


def _check_zero(results: list[dict], flags: dict, expert_ranks: int) -> None:
    _check(results, 4 // flags["ep"], "capacity_factor" in flags)
    for result in results:
        dense_ranks = len(results) // (flags.get("tp", 1) * flags.get("pp", 1))  # dp·ep
        assert result["shard ranks"] == {"dense": dense_ranks, "experts": expert_ranks}, result
        if "memory" not in result:  # a pipeline stage's ZeRO: no whole-model memory report
            continue
        # the per-rank memory report: every rank's accounted bytes equal the ZeRO formula summed over
        # the dense weights (N = dp·ep) and the experts (N = dp)
        lines = [line.strip() for line in result["memory"] if line.strip().startswith(("rank ", "formula:"))]
        accounted = {line.split(":")[0]: line.split(":")[1].split("(total")[0] for line in lines}
        assert set(accounted.values()) == {accounted["formula"]}, result["memory"]
        assert re.search(rf"N = {dense_ranks}, experts N = {expert_ranks}\)", result["memory"][-1])


@pytest.mark.parametrize(("ranks", "flags", "expert_ranks"), LAYOUTS.values(), ids=LAYOUTS.keys())
def test_zero_with_expert_parallel_trains_as_one_process_does(
    text: str, ranks: int, flags: dict, expert_ranks: int
) -> None:
    results = spawn(_compare, ranks, args=(text, flags | {"nproc": ranks}), timeout=115)
    _check_zero(results, flags, expert_ranks)


#: four ranks: experts sharded over dp 2; and ZeRO over tensor-parallel shards with experts (whole on
#: every tp rank) sharded over their one holder
SLOW_LAYOUTS: dict[str, tuple[dict, int]] = {
    "zero3·ep2·dp2": ({"zero": 3, "ep": 2, "capacity_factor": 1.0}, 2),
    "zero2·ep2·tp2": ({"zero": 2, "ep": 2, "tp": 2}, 1),
    # ZeRO on each pipeline stage: the stage's dense weights over dp·ep, its experts over dp (here one)
    "zero1·ep2·pp2": ({"zero": 1, "ep": 2, "pp": 2}, 1),
    "zero3·ep2·pp2": ({"zero": 3, "ep": 2, "pp": 2, "capacity_factor": 1.0}, 1),
}


@pytest.mark.slow
@pytest.mark.parametrize(("flags", "expert_ranks"), SLOW_LAYOUTS.values(), ids=SLOW_LAYOUTS.keys())
def test_zero_ep_on_four_ranks_trains_as_one_process_does(text: str, flags: dict, expert_ranks: int) -> None:
    results = spawn(_compare, 4, args=(text, flags | {"nproc": 4}), timeout=115)
    _check_zero(results, flags, expert_ranks)


def test_the_strategy_line_says_over_which_ranks_experts_are_sharded() -> None:
    strategy = {"zero": 3, "dp": 4, "ep": 2, "tp": 1, "pp": 1, "sp": False, "cp": 1}
    assert (
        strategy_line(strategy) == "ZeRO-3 over dp 4, experts over ep 2 of them, each ZeRO-sharded over dp 2"
    )


# ---------------------------------------------------------------------------------------------- resume
def _train(text: str, root: str, flags: dict, resume: bool) -> dict:
    return resume_run(_config(text, checkpoint=f"{root}/ckpt", resume=resume, capacity_factor=1.0, **flags))


#: name → (layout A's flags, layout B's flags): B resumes A's checkpoint
RESUMES = {
    "zero3·ep2 → ep2": ({"zero": 3, "ep": 2}, {"ep": 2}),
    "zero3·ep2 → zero2 on one process": ({"zero": 3, "ep": 2}, {"nproc": 1, "zero": 2, "ep": 1}),
    "ep2 → zero1·ep2": ({"ep": 2}, {"zero": 1, "ep": 2}),
}


@pytest.mark.parametrize(("first", "then"), RESUMES.values(), ids=RESUMES.keys())
def test_a_zero_ep_checkpoint_resumes_exactly_on_another_layout(text: str, tmp_path, first, then) -> None:
    root = str(tmp_path)
    a = spawn(_train, 2, args=(text, root, first, False), timeout=110)[0]
    b = spawn(_train, then.get("nproc", 2), args=(text, root, then, True), timeout=110)[0]
    assert_resumed(a, b, LOSS_TOLERANCE, PARAM_TOLERANCE)
