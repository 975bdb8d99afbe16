"""Pipeline schedules as plain data: per-rank lists of instructions, testable without processes (each
schedule's order, bubble and memory: docs/pipeline.md).

A model cut into ``C = p·v`` chunks (virtual stages) runs on ``p`` ranks; chunk ``c`` lives on rank
``c % p``. A step pushes ``m`` micro-batches through the chunks. Each rank executes its list in order:
compute (``F`` forward, ``B`` backward, ``W`` weight gradient) and point-to-point transfers (activations
forward, their gradients backward). Transfers are derived from the compute order, so a schedule only
decides *which compute comes next*: GPipe, 1F1B (Narayanan et al. 2021) and interleaved 1F1B share one
warm-up / steady / cool-down skeleton (:func:`_compute_order`); ZB-H1 (Qi et al. 2023) is found by list
scheduling (:func:`_zero_bubble_orders`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


class Op(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"  # the whole backward, or only the input gradient when the schedule splits it
    WEIGHT = "W"  # weight gradient of a split backward
    SEND_ACT = "send_act"
    RECV_ACT = "recv_act"
    SEND_GRAD = "send_grad"
    RECV_GRAD = "recv_grad"


COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)


@dataclass(frozen=True)
class Instruction:
    """One step of a rank: ``op`` on micro-batch ``micro_batch`` of chunk ``chunk`` (global index).

    For transfers ``peer`` is the other rank; ``chunk`` is the chunk whose output (``send_act``), input
    (``recv_act``), input gradient (``send_grad``) or output gradient (``recv_grad``) moves.
    """

    op: Op
    micro_batch: int
    chunk: int
    peer: int | None = None

    def __str__(self) -> str:
        arrow = "→" if self.op.value.startswith("send") else "←"
        peer = "" if self.peer is None else f"{arrow}{self.peer}"
        return f"{self.op.value}{self.micro_batch}@{self.chunk}{peer}"


@dataclass(frozen=True)
class Schedule:
    """A complete schedule: ``ranks[r]`` is rank r's instruction list."""

    name: str
    stages: int
    micro_batches: int
    virtual_stages: int
    split_backward: bool
    ranks: tuple[tuple[Instruction, ...], ...]

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual_stages

    def owner(self, chunk: int) -> int:
        return chunk % self.stages

    def local_chunks(self, rank: int) -> list[int]:
        return [j * self.stages + rank for j in range(self.virtual_stages)]


def build_schedule(name: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """The named schedule for ``stages`` ranks, ``micro_batches`` per step and ``virtual_stages`` chunks;
    ``ValueError`` saying what to change when none of these sizes exists (cheap: a check before launch)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if stages < 1 or micro_batches < 1 or virtual_stages < 1:
        raise ValueError(
            f"pipeline sizes must be at least 1, got stages={stages}, micro-batches={micro_batches}, "
            f"virtual stages={virtual_stages}"
        )
    if name != "interleaved" and virtual_stages != 1:
        raise ValueError(
            f"--virtual-stages {virtual_stages} needs --schedule interleaved ({name} runs one chunk per rank)"
        )
    if name == "interleaved" and micro_batches % stages:
        raise ValueError(
            f"interleaved 1F1B visits chunks in groups of {stages} micro-batches: --micro-batches "
            f"{micro_batches} must be a multiple of --pp {stages} "
            f"(e.g. {stages * -(-micro_batches // stages)})"
        )
    p, m, v = stages, micro_batches, virtual_stages
    if name == "zb":
        orders = _zero_bubble_orders(p, m)
    else:
        orders = [_compute_order(name, r, p, m, v) for r in range(p)]
    ranks = tuple(tuple(_with_transfers(order, p * v, p)) for order in orders)
    return Schedule(name, p, m, v, name == "zb", ranks)


Compute = tuple[Op, int, int]  # (op, micro-batch, chunk)


def _compute_order(name: str, rank: int, p: int, m: int, v: int) -> list[Compute]:
    total = m * v
    # GPipe is all warm-up; interleaved fills every chunk of the rank before the first backward can arrive
    warmup = {"gpipe": m, "1f1b": min(p - rank - 1, m)}.get(
        name, min((p - rank - 1) * 2 + (v - 1) * p, total)
    )

    def forward(i: int) -> Compute:
        group, within = divmod(i, p * v)
        return (Op.FORWARD, group * p + within % p, (within // p) * p + rank)

    def backward(i: int) -> Compute:
        group, within = divmod(i, p * v)
        return (Op.BACKWARD, group * p + within % p, (v - 1 - within // p) * p + rank)

    order = [forward(i) for i in range(warmup)]
    for i in range(total - warmup):
        order += [forward(warmup + i), backward(i)]
    return order + [backward(i) for i in range(total - warmup, total)]


def _zero_bubble_orders(p: int, m: int) -> list[list[Compute]]:
    """ZB-H1: the backward split into B (input gradient, on the critical path) and W (weight gradient,
    needed by nobody downstream), W deferred into the idle slots 1F1B leaves. List scheduling in unit time
    (priority B > F > W) under 1F1B's memory: at most ``p − r`` micro-batches between F and B on rank
    ``r``, and at most ``p`` whose W is owed. Without the second bound the same scheduler reaches the
    paper's (p−1)/(3m+p−1) but holds all ``m`` micro-batches' weight-gradient inputs; with it the bubble
    lies between that and 1F1B's (p = 4, m = 8: 0.17 vs 0.11 vs 0.27)."""
    done: dict[tuple[Op, int, int], int] = {}  # (op, micro-batch, stage) → finish time
    orders: list[list[Compute]] = [[] for _ in range(p)]
    next_f, next_b, pending_w = [0] * p, [0] * p, [[] for _ in range(p)]
    free_at, time = [0] * p, 0
    while any(len(order) < 3 * m for order in orders):
        for r in range(p):
            if free_at[r] > time:
                continue
            k = next_b[r]
            b_ready = k < next_f[r] and (r == p - 1 or done.get((Op.BACKWARD, k, r + 1), time + 1) <= time)
            k_f = next_f[r]
            f_ready = k_f < m and (r == 0 or done.get((Op.FORWARD, k_f, r - 1), time + 1) <= time)
            if b_ready:
                choice = (Op.BACKWARD, k, r)
                next_b[r] += 1
                pending_w[r].append(k)
            elif f_ready and k_f - next_b[r] < p - r and k_f - (next_b[r] - len(pending_w[r])) < p:
                choice = (Op.FORWARD, k_f, r)
                next_f[r] += 1
            elif pending_w[r]:
                choice = (Op.WEIGHT, pending_w[r].pop(0), r)
            else:
                continue
            orders[r].append(choice)
            done[choice] = time + 1
            free_at[r] = time + 1
        time += 1
    return orders


def _with_transfers(order: list[Compute], chunks: int, p: int) -> list[Instruction]:
    """Insert the receive each compute needs before it and the send its result feeds after it."""
    out: list[Instruction] = []
    for op, k, c in order:
        if op is Op.FORWARD and c > 0 and (c - 1) % p != c % p:
            out.append(Instruction(Op.RECV_ACT, k, c, (c - 1) % p))
        if op is Op.BACKWARD and c < chunks - 1 and (c + 1) % p != c % p:
            out.append(Instruction(Op.RECV_GRAD, k, c, (c + 1) % p))
        out.append(Instruction(op, k, c))
        if op is Op.FORWARD and c < chunks - 1 and (c + 1) % p != c % p:
            out.append(Instruction(Op.SEND_ACT, k, c, (c + 1) % p))
        if op is Op.BACKWARD and c > 0 and (c - 1) % p != c % p:
            out.append(Instruction(Op.SEND_GRAD, k, c, (c - 1) % p))
    return out
