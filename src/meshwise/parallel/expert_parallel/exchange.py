"""The expert-parallel exchange: tokens go to the rank holding their expert and come back, exactly.

A :class:`~meshwise.models.moe.MixtureOfExperts` hands its kept assignments, grouped by global expert, to
its ``exchange``; :class:`AllToAllExchange` is that hook on ``ep`` ranks holding E/ep experts each:
(1) an all-to-all of counts tells each rank how many rows every rank sends to each of its experts;
(2) an uneven all-to-all of the rows, source-major; (3) a regroup to expert-major order, the local
experts, the inverse regroup; (4) the reverse all-to-all brings each row back to where it came from.

Every step has an exact backward — the all-to-all's gradient is the all-to-all with the sizes swapped
(:class:`_AllToAllRows`), the regroups are permutations — and every rank calls every collective even
with nothing to send, so forward and backward collectives pair up on every rank in the same order.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor

from meshwise.comm.api import Communicator
from meshwise.parallel.protocols import RunExperts


def all_to_all_rows(comm: Communicator, tensor: Tensor, send_rows: list[int], recv_rows: list[int]) -> Tensor:
    """Rows ``send_rows[j]`` of ``tensor`` (in rank order) go to rank j; returns the rows received,
    ``recv_rows[i]`` from rank i, concatenated. The one place the dispatcher touches the Communicator:
    the split-size ``all_to_all_single``, whose mismatched splits are named on every rank."""
    tensor = tensor.contiguous()
    received = tensor.new_empty((sum(recv_rows), *tensor.shape[1:]))
    comm.all_to_all_single(received, tensor, recv_rows, send_rows)
    return received


class ExchangeTimer:
    """Seconds spent in the dispatch and in the combine (forward and backward), summed until reset.
    On a GPU the device is drained at both ends, so queued compute is not charged to the exchange."""

    def __init__(self) -> None:
        self.seconds = {"dispatch": 0.0, "combine": 0.0}

    @contextmanager
    def time(self, part: str, device: torch.device) -> Iterator[None]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        try:
            yield
        finally:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.seconds[part] += time.perf_counter() - started


def _timed(timer: ExchangeTimer | None, part: str, tensor: Tensor) -> AbstractContextManager[None]:
    return nullcontext() if timer is None else timer.time(part, tensor.device)


class _AllToAllRows(torch.autograd.Function):
    """:func:`all_to_all_rows` with its exact gradient (the sizes swapped), timed as ``part`` if ``timer``."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: Tensor,
        comm: Communicator,
        send_rows: list[int],
        recv_rows: list[int],
        timer: ExchangeTimer | None,
        part: str,
    ) -> Tensor:
        ctx.comm, ctx.send_rows, ctx.recv_rows, ctx.timer, ctx.part = comm, send_rows, recv_rows, timer, part
        return all_to_all_rows(comm, tensor, send_rows, recv_rows)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        with _timed(ctx.timer, ctx.part, grad):
            back = all_to_all_rows(ctx.comm, grad, ctx.recv_rows, ctx.send_rows)
        return back, None, None, None, None, None


def expert_major_order(counts: Tensor) -> Tensor:
    """The permutation that turns rows laid out source-major — ``counts[i, e]`` rows from rank i for
    local expert e, i outer — into expert-major order (e outer, then source rank): a stable sort of the
    rows by their expert keeps each expert's rows in source order."""
    sources, experts = counts.shape
    expert_of_row = torch.arange(experts).repeat(sources).repeat_interleave(counts.reshape(-1))
    return torch.argsort(expert_of_row, stable=True)


class AllToAllExchange:
    """The ``exchange`` of a MoE layer whose E experts are spread over the ranks of ``comm``, E/ep each."""

    def __init__(self, comm: Communicator, experts: int) -> None:
        self.comm, self.experts = comm, experts
        self.local = experts // comm.world_size
        self.timer: ExchangeTimer | None = None  # set to time dispatch and combine (--profile)

    def __call__(self, grouped: Tensor, counts: Tensor, run: RunExperts) -> Tensor:
        ranks, local, timer = self.comm.world_size, self.local, self.timer
        with _timed(timer, "dispatch", grouped):
            # 1. counts: slot j of ours (our rows for j's experts) becomes row `rank` of j's matrix.
            received_counts = torch.empty_like(counts)
            self.comm.all_to_all_single(received_counts, counts.contiguous())
            matrix = received_counts.reshape(ranks, local).cpu()  # [source rank, local expert]
            send_rows = counts.reshape(ranks, local).sum(dim=1).tolist()
            recv_rows = matrix.sum(dim=1).tolist()
            # 2. rows to the experts' ranks, source-major
            arrived = _AllToAllRows.apply(grouped, self.comm, send_rows, recv_rows, timer, "dispatch")
        # 3. regroup, run, regroup back.
        order = expert_major_order(matrix).to(arrived.device)
        outputs = run(arrived.index_select(0, order), matrix.sum(dim=0).tolist())
        back = outputs.index_select(0, torch.argsort(order))
        # 4. results home, in the order they were sent.
        with _timed(timer, "combine", back):
            return _AllToAllRows.apply(back, self.comm, recv_rows, send_rows, timer, "combine")
