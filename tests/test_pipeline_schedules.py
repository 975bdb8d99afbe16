"""Pipeline schedules and partition as plain data: the whole simulator matrix runs without processes."""

from __future__ import annotations

import pytest

from meshwise.models.gpt import GPT, GPTConfig
from meshwise.models.gpt_plan import gpt_plan
from meshwise.parallel.pipeline_parallel import (
    Instruction,
    Op,
    Schedule,
    ScheduleError,
    build_schedule,
    partition,
    simulate,
    theoretical_bubble,
)
from meshwise.parallel.pipeline_parallel.builder import micro_batches_of, validate_pipeline
from meshwise.parallel.pipeline_parallel.partition import balanced_split

STAGES = range(1, 9)
MICRO = range(1, 17)


@pytest.mark.parametrize("p", STAGES)
def test_gpipe_and_1f1b_bubble_and_memory(p: int) -> None:
    for m in MICRO:
        gpipe, one_f = simulate(build_schedule("gpipe", p, m)), simulate(build_schedule("1f1b", p, m))
        theory = theoretical_bubble(p, m)
        assert gpipe.bubble == pytest.approx(theory, abs=1e-12), (p, m)
        assert one_f.bubble == pytest.approx(theory, abs=1e-12), (p, m)
        assert gpipe.peak_in_flight == (m,) * p  # GPipe holds every micro-batch
        assert max(one_f.peak_in_flight) == min(p, m)  # 1F1B at most p
        assert all(held <= p - r for r, held in enumerate(one_f.peak_in_flight))


@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("v", [1, 2, 4])
def test_interleaved_bubble_is_divided_by_v(p: int, v: int) -> None:
    for m in range(p, 17, p):
        sim = simulate(build_schedule("interleaved", p, m, v))
        assert sim.bubble == pytest.approx(theoretical_bubble(p, m, v), abs=1e-12), (p, m, v)


@pytest.mark.parametrize("p", STAGES)
def test_zero_bubble_beats_1f1b_within_its_memory(p: int) -> None:
    for m in MICRO:
        zb, one_f = simulate(build_schedule("zb", p, m)), simulate(build_schedule("1f1b", p, m))
        if p > 1:
            assert zb.bubble < one_f.bubble, (p, m, zb.bubble, one_f.bubble)
        assert zb.bubble >= (p - 1) / (3 * m + p - 1) - 1e-12  # never below the ZB-H1 bound
        assert max(zb.peak_in_flight) <= p


def test_schedule_text_of_1f1b_rank0() -> None:
    ranks = build_schedule("1f1b", 2, 3).ranks
    assert " ".join(map(str, ranks[0])) == (
        "F0@0 send_act0@0→1 F1@0 send_act1@0→1 recv_grad0@0←1 B0@0 F2@0 send_act2@0→1 "
        "recv_grad1@0←1 B1@0 recv_grad2@0←1 B2@0"
    )
    assert " ".join(map(str, ranks[1])) == (
        "recv_act0@1←0 F0@1 B0@1 send_grad0@1→0 recv_act1@1←0 F1@1 B1@1 send_grad1@1→0 "
        "recv_act2@1←0 F2@1 B2@1 send_grad2@1→0"
    )


def _swap(schedule: Schedule, rank: int, a: int, b: int) -> Schedule:
    program = list(schedule.ranks[rank])
    program[a], program[b] = program[b], program[a]
    ranks = list(schedule.ranks)
    ranks[rank] = tuple(program)
    return Schedule(
        schedule.name,
        schedule.stages,
        schedule.micro_batches,
        schedule.virtual_stages,
        schedule.split_backward,
        tuple(ranks),
    )


def test_simulator_rejects_broken_schedules() -> None:
    good = build_schedule("1f1b", 2, 2)
    # rank 1 receives micro-batch 1 before 0: messages between the pair would cross
    recvs = [i for i, ins in enumerate(good.ranks[1]) if ins.op is Op.RECV_ACT]
    with pytest.raises(ScheduleError, match="different orders"):
        simulate(_swap(good, 1, recvs[0], recvs[1]))
    # rank 0 waits for a gradient before sending the activation it depends on: a cycle
    program = good.ranks[0]
    first_recv = next(i for i, ins in enumerate(program) if ins.op is Op.RECV_GRAD)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(_swap(good, 0, 0, first_recv))
    # a backward before its forward
    with pytest.raises(ScheduleError, match="before"):
        simulate(_swap(good, 0, 0, next(i for i, ins in enumerate(program) if ins.op is Op.BACKWARD)))
    # a missing backward
    ranks = (good.ranks[0][:-1], good.ranks[1])
    with pytest.raises(ScheduleError, match="missing"):
        simulate(Schedule("1f1b", 2, 2, 1, False, ranks))
    assert Instruction(Op.FORWARD, 0, 0) in good.ranks[0]


def test_bad_input_names_the_fix() -> None:
    config = GPTConfig(layers=4, hidden=32, heads=4, seq_len=8).layers
    with pytest.raises(ValueError, match="4 layers cannot be cut into 8 pipeline chunks"):
        validate_pipeline(config, 4, 8, "interleaved", 2)
    with pytest.raises(ValueError, match="must be a multiple of --pp 4"):
        validate_pipeline(config, 4, 6, "interleaved", 1)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'"):
        validate_pipeline(config, 2, 4, "pipedream")
    with pytest.raises(ValueError, match="needs --schedule interleaved"):
        validate_pipeline(config, 2, 4, "1f1b", 2)
    with pytest.raises(ValueError, match="multiple of --micro-batches"):
        micro_batches_of(__import__("torch").zeros(6, 3), 4)


def test_partition_balances_blocks_and_keeps_names() -> None:
    assert balanced_split([1] * 8, 4) == [2, 2, 2, 2]
    assert balanced_split([1] * 8, 3, first_extra=2, last_extra=2) == [2, 4, 2]
    config = GPTConfig(layers=6, hidden=32, heads=4, seq_len=8, vocab=2048)  # heavy embedding and head
    model = GPT(config)
    plan = gpt_plan(config)
    chunks = partition(model, plan, 3)
    assert [len(c.blocks) for c in chunks] == [1, 4, 1]
    assert [len(c.layers) for c in partition(model, plan, 3, layers_per_chunk=[2, 2, 2])] == [2, 2, 2]
    names = {n for c in chunks for n, _ in c.named_parameters()}
    assert names == {n for n, _ in model.named_parameters(remove_duplicate=False)}
    with pytest.raises(ValueError, match="summing to the model's 6 layers"):
        partition(model, plan, 3, layers_per_chunk=[2, 2, 1])
