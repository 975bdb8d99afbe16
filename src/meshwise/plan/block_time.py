"""One tensor-parallel rank's transformer block, timed on this host (the ``cpu`` preset).

The compute term prices the blocks as FLOPs over a rate measured from one whole block's forward +
backward. A tp rank runs another block: the model's own shard (:mod:`meshwise.models.gpt_plan`'s
``ParallelAttention`` and ``ParallelMLP``), column-parallel q/k/v and fc of width h/t and 4h/t,
row-parallel out and proj, while the LayerNorms, residual adds, dropout and biases stay whole over h
(with sequence parallelism on s/t tokens, plus the gathered input's copies). Its GEMMs have other shapes
than the whole block's at the same FLOPs, and its replicated work does not shrink with t, so ``cpu``
times it per tp degree, over a :class:`LocalGroup` whose collectives only write their outputs (the calls
themselves are priced by the tp term).

Recomputation stays priced by the FLOPs it repeats: timed here (one thread, in alternation with the
plain block), a block's forward was 0.31–0.37 of its forward + backward and full recomputation 1.23–1.29×
the plain block at micro-batch 4 — a third and 4/3, as the FLOP count says. Nothing here starts a process.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from meshwise.models.gpt import GPTConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

#: micro-batches (sequences per forward) the whole block's curve is measured at
MICRO_BATCHES = (1, 2, 4, 8, 16)
#: the whole block's micro-batches a shard is paired with (the shard at t times as many): beyond 4 the
#: whole block's rate is flat on a CPU, and pairing a tp2 shard at 32 sequences took seconds
SHARD_PAIRS = (1, 2, 4)


class LocalGroup:
    """Rank 0 of a ``size``-rank tensor-parallel group whose collectives only write their outputs here
    (every rank's contribution taken to be this rank's): the shard's arithmetic and copies run as in a
    job, the communication is left to the tp term."""

    def __init__(self, size: int) -> None:
        self.rank, self.world_size = 0, size

    def all_reduce(
        self, tensor: torch.Tensor, op: str = "sum", *, output: torch.Tensor | None = None
    ) -> None:
        if output is not None:
            output.copy_(tensor)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        output.copy_(input.unsqueeze(0).expand_as(output))

    def reduce_scatter(self, output: torch.Tensor, input: list[torch.Tensor], op: str = "sum") -> None:
        output.copy_(input[self.rank])


def shard_block(config: GPTConfig, tp: int, sp: bool) -> nn.Module:
    """One tp rank's block of ``config`` (the whole block at tp 1), as
    :func:`meshwise.models.gpt_plan.tensor_parallel` converts it; under sp the replicated parameters'
    gradients are summed over the group, as there."""
    from meshwise.models.gpt import Block
    from meshwise.models.gpt_plan import ParallelAttention, ParallelMLP
    from meshwise.parallel.tensor_parallel import shard_dim
    from meshwise.parallel.tensor_parallel.layers import sum_gradient_over

    block = Block(config)
    if tp == 1:
        return block
    group = LocalGroup(tp)
    block.attn = ParallelAttention(block.attn, group, sp)  # type: ignore[arg-type]
    block.mlp = ParallelMLP(block.mlp, group, sp)  # type: ignore[arg-type]
    if sp:
        for param in block.parameters():
            if shard_dim(param) is None:
                sum_gradient_over(param, group)  # type: ignore[arg-type]
    return block


def _step(block: nn.Module, x: torch.Tensor) -> Callable[[], object]:
    return lambda: block(x).sum().backward()


def block_flops_per_token(config: GPTConfig) -> float:
    """One block's training FLOPs per token: 6 × its 12h² + 13h parameters, plus 12·h·s for QKᵀ and AV."""
    h = config.hidden
    return 6 * (12 * h * h + 13 * h) + 12 * h * config.seq_len


def block_rates(config: GPTConfig, micro_batches: tuple[int, ...] = MICRO_BATCHES) -> dict[float, float]:
    """FLOP/s the whole block reaches in forward + backward here (median run), keyed by its largest GEMM
    (2·b·s·h·4h, where :mod:`meshwise.plan.step_time` evaluates the curve): on a CPU the non-matmul work
    (LayerNorm, GELU, attention, autograd) is a large share, and this measures it with the rest."""
    import torch

    from meshwise.plan.hardware import typical_time

    torch.manual_seed(0)
    s, h = config.seq_len, config.hidden
    block = shard_block(config, 1, False)
    points = {}
    for b in micro_batches:
        x = torch.randn(b, s, h, requires_grad=True)
        points[2.0 * b * s * h * 4 * h] = (
            block_flops_per_token(config) * b * s / typical_time(_step(block, x))
        )
    return points


def paired_times(
    first: Callable[[], object], second: Callable[[], object], seconds: float = 0.3, least: int = 5
) -> tuple[float, float]:
    """Median seconds of ``first`` and of ``second`` run in alternation (after a warm-up of each), so that
    the host's load changing meanwhile lands on both."""
    first(), second()
    a: list[float] = []
    b: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(a) < least or time.perf_counter() < deadline:
        for work, times in ((first, a), (second, b)):
            started = time.perf_counter()
            work()
            times.append(time.perf_counter() - started)
    return statistics.median(a), statistics.median(b)


def shard_rates(config: GPTConfig, tp: int, sp: bool, whole: dict[float, float]) -> dict[float, float]:
    """FLOP/s one tp rank's block reaches in forward + backward here, keyed by its largest GEMM
    (2·b·s·h·4h/t), at the GEMM sizes of ``whole`` (:func:`block_rates`) for b in :data:`SHARD_PAIRS`
    (the curve is flat past its last point). At micro-batch t·b the shard does the FLOPs the whole
    block does at b and has the same key, so each point is ``whole``'s rate there times how much faster
    the shard ran than the whole block at b, the two timed in alternation: measured apart, a few
    seconds of the host's other jobs moved one curve against the other 2×."""
    import torch

    torch.manual_seed(0)
    s, h = config.seq_len, config.hidden
    block, shard = shard_block(config, 1, False), shard_block(config, tp, sp)
    points = {}
    for key, rate in whole.items():
        b = round(key / (2.0 * s * h * 4 * h))
        if b not in SHARD_PAIRS:
            continue
        x = torch.randn(b, s, h, requires_grad=True)
        y = torch.randn(b * tp, s // tp if sp else s, h, requires_grad=True)
        plain, sharded = paired_times(_step(block, x), _step(shard, y))
        points[key] = rate * plain / sharded
    return points
