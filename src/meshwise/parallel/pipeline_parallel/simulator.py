"""Run a :class:`Schedule` in unit time without processes, and prove it sound (docs/pipeline.md).

Semantics are the executor's: a send never blocks (``isend``), a receive blocks until the matching send
was posted, messages between two ranks arrive in posting order. :func:`simulate` raises
:class:`ScheduleError` when a rank computes the wrong set, a compute runs before its inputs exist, the
k-th message of a pair is not what the k-th receive expects, or the ranks deadlock; it measures the
makespan, the bubble and the peak activations each rank holds (a forward done whose backward — or weight
gradient, when split — is not). Costs per chunk: F = 1, B = 1 and W = 1 when the backward is split, B = 2
otherwise.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from meshwise.parallel.pipeline_parallel.schedules import COMPUTE, Instruction, Op, Schedule


class ScheduleError(ValueError):
    """The schedule is incomplete, out of order, mismatched or deadlocks."""


@dataclass(frozen=True)
class Simulation:
    makespan: float
    busy: tuple[float, ...]  # compute time of each rank
    peak_in_flight: tuple[int, ...]  # most (chunk, micro-batch) activations held at once, per rank

    @property
    def bubble(self) -> float:
        """Idle fraction of the step, averaged over ranks."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)


def cost(op: Op, split_backward: bool) -> float:
    if op is Op.BACKWARD:
        return 1.0 if split_backward else 2.0
    return 1.0 if op in COMPUTE else 0.0


Durations = dict[tuple[str, int, int], float]  # (op letter, micro-batch, chunk) → seconds


def simulate(schedule: Schedule, durations: Durations | None = None) -> Simulation:
    """Execute ``schedule`` in unit time; raise :class:`ScheduleError` when it is not sound.

    With ``durations`` (e.g. measured ones, see :func:`timeline.replay`) each compute takes its
    own time instead: the makespan a perfect executor with free messages would reach on those ops.
    """
    _check_complete(schedule)

    def duration(ins: Instruction) -> float:
        if durations is None or ins.op not in COMPUTE:
            return cost(ins.op, schedule.split_backward)
        return durations[(ins.op.value, ins.micro_batch, ins.chunk)]

    p = schedule.stages
    clock = [0.0] * p
    position = [0] * p
    #: (op, micro-batch, chunk) → when it finished (a compute) or its message arrived (a receive)
    finished: dict[tuple[Op, int, int], float] = {}
    mailbox: dict[tuple[int, int], deque[tuple[Instruction, float]]] = {}
    held, peak = [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            program = schedule.ranks[r]
            while position[r] < len(program):
                ins = program[position[r]]
                if ins.op in (Op.SEND_ACT, Op.SEND_GRAD):
                    mailbox.setdefault((r, ins.peer), deque()).append((ins, clock[r]))
                elif ins.op in (Op.RECV_ACT, Op.RECV_GRAD):
                    queue = mailbox.get((ins.peer, r))
                    if not queue:
                        break
                    sent, at = queue.popleft()
                    _check_match(sent, ins, r)
                    clock[r] = max(clock[r], at)
                    finished[(ins.op, ins.micro_batch, ins.chunk)] = at
                else:
                    start = max(clock[r], _ready_at(schedule, ins, finished, r))
                    clock[r] = start + duration(ins)
                    finished[(ins.op, ins.micro_batch, ins.chunk)] = clock[r]
                    releases = Op.WEIGHT if schedule.split_backward else Op.BACKWARD
                    held[r] += ins.op is Op.FORWARD
                    held[r] -= ins.op is releases
                    peak[r] = max(peak[r], held[r])
                position[r] += 1
                progress = True
    blocked = [r for r in range(p) if position[r] < len(schedule.ranks[r])]
    if blocked:
        waits = ", ".join(f"rank {r} at {schedule.ranks[r][position[r]]}" for r in blocked)
        raise ScheduleError(f"{schedule.name}: deadlock, every remaining rank waits on a receive: {waits}")
    busy = tuple(sum(duration(i) for i in program) for program in schedule.ranks)
    return Simulation(max(clock), busy, tuple(peak))


def _check_complete(schedule: Schedule) -> None:
    wanted = [Op.FORWARD, Op.BACKWARD] + ([Op.WEIGHT] if schedule.split_backward else [])
    for r, program in enumerate(schedule.ranks):
        have = Counter((i.op, i.micro_batch, i.chunk) for i in program if i.op in COMPUTE)
        expected = Counter(
            (op, k, c)
            for op in wanted
            for k in range(schedule.micro_batches)
            for c in schedule.local_chunks(r)
        )
        if have != expected:
            missing, extra = expected - have, have - expected
            raise ScheduleError(
                f"{schedule.name}: rank {r} computes the wrong set (missing {sorted(missing)[:4]}, "
                f"extra {sorted(extra)[:4]})"
            )


_MATCH = {Op.SEND_ACT: (Op.RECV_ACT, 1), Op.SEND_GRAD: (Op.RECV_GRAD, -1)}


def _check_match(sent: Instruction, received: Instruction, rank: int) -> None:
    kind, shift = _MATCH[sent.op]
    if (received.op, received.micro_batch, received.chunk) != (kind, sent.micro_batch, sent.chunk + shift):
        raise ScheduleError(
            f"rank {rank} expected {received} but the next message from rank {received.peer} is {sent}: "
            "sends and receives between this pair are in different orders"
        )


def _ready_at(
    schedule: Schedule, ins: Instruction, finished: dict[tuple[Op, int, int], float], rank: int
) -> float:
    """When the inputs of a compute instruction exist; raises if one is never produced before it. Chunks
    c and c ± 1 share a rank only in a one-rank pipeline: otherwise a neighbour's result is received."""
    k, c, local = ins.micro_batch, ins.chunk, schedule.stages == 1
    needs: list[tuple[Op, int, int]] = []
    if ins.op is Op.FORWARD and c > 0:
        needs.append((Op.FORWARD, k, c - 1) if local else (Op.RECV_ACT, k, c))
    if ins.op is Op.BACKWARD:
        needs.append((Op.FORWARD, k, c))
        if c < schedule.chunks - 1:
            needs.append((Op.BACKWARD, k, c + 1) if local else (Op.RECV_GRAD, k, c))
    if ins.op is Op.WEIGHT:
        needs.append((Op.BACKWARD, k, c))
    for need in needs:
        if need not in finished:
            raise ScheduleError(f"{schedule.name}: rank {rank} runs {ins} before {Instruction(*need)}")
    return max((finished[need] for need in needs), default=0.0)
