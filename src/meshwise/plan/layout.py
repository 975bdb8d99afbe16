"""One way to lay a training step on the GPUs: dp·tp·pp, ZeRO stage, micro-batch, schedule, recomputation.

:func:`check` says in one line why a layout cannot run a model at all (sizes that do not divide); whether
it *fits* is the memory model's business. The pipeline quantities here — micro-batch activations each
schedule keeps in flight on its busiest rank (the first), and the idle fraction — are closed forms that
the tests check against :mod:`meshwise.parallel.pipeline_parallel.simulator` on every small case.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshwise.models.gpt import GPTConfig
from meshwise.parallel.pipeline_parallel.simulator import theoretical_bubble

#: schedules the planner prices (zero-bubble needs per-op weight-gradient costs it does not model)
SCHEDULES = ("1f1b", "interleaved", "gpipe")
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True, order=True)
class Layout:
    dp: int
    tp: int
    pp: int
    zero: int = 0
    micro_batch: int = 1  # sequences per forward on one rank
    schedule: str = "1f1b"  # ignored when pp == 1
    virtual: int = 1  # model chunks per pipeline rank (interleaved)
    recompute: str = "none"
    sp: bool = False  # sequence parallelism (with tp > 1)

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def micro_batches(self, global_batch: int) -> int:
        """Micro-batches per rank per step (gradient accumulation, or the pipeline's m)."""
        return global_batch // (self.dp * self.micro_batch)

    def in_flight(self, global_batch: int) -> int:
        """Chunk activations the first pipeline rank holds at its peak (1 without a pipeline)."""
        m, p, v = self.micro_batches(global_batch), self.pp, self.virtual
        if p == 1:
            return 1
        if self.schedule == "gpipe":
            return m
        if self.schedule == "interleaved":
            return min(m * v, 2 * (p - 1) + (v - 1) * p + 1)
        return min(m, p)

    def bubble(self, global_batch: int) -> float:
        """Idle fraction of the pipeline: (p−1)/(v·m + p−1)."""
        if self.pp == 1:
            return 0.0
        return theoretical_bubble(self.pp, self.micro_batches(global_batch), self.virtual)

    def name(self) -> str:
        """Short label: ``dp8·tp2·pp4 z1 mb2 interleaved×2 sel sp``."""
        parts = [f"dp{self.dp}·tp{self.tp}·pp{self.pp}"]
        if self.zero:
            parts.append(f"z{self.zero}")
        parts.append(f"mb{self.micro_batch}")
        if self.pp > 1:
            parts.append(self.schedule + (f"×{self.virtual}" if self.virtual > 1 else ""))
        if self.recompute != "none":
            parts.append({"selective": "sel", "full": "full-ac"}[self.recompute])
        if self.sp:
            parts.append("sp")
        return " ".join(parts)


def check(layout: Layout, model: GPTConfig, gpus: int, global_batch: int) -> None:
    """Raise ValueError, one line naming what to change, if ``layout`` cannot run ``model`` at all."""
    dp, tp, pp = layout.dp, layout.tp, layout.pp
    if min(dp, tp, pp, layout.micro_batch, layout.virtual) < 1:
        raise ValueError(f"{layout.name()}: sizes must be at least 1")
    if dp * tp * pp != gpus:
        raise ValueError(
            f"dp {dp} × tp {tp} × pp {pp} = {dp * tp * pp}, not the {gpus} GPUs: make the "
            "product equal --gpus"
        )
    if model.heads % tp:
        raise ValueError(
            f"--tp {tp} does not divide the {model.heads} attention heads: choose a divisor of {model.heads}"
        )
    if layout.sp and tp == 1:
        raise ValueError("sequence parallelism needs --tp 2 or more")
    if layout.sp and model.seq_len % tp:
        raise ValueError(f"--seq-len {model.seq_len} is not divisible by --tp {tp} (sequence parallelism)")
    if pp * layout.virtual > model.layers:
        raise ValueError(f"pp {pp} × {layout.virtual} chunks > {model.layers} layers: lower --pp")
    if layout.zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero must be 0..3, got {layout.zero}")
    if layout.recompute not in RECOMPUTE:
        raise ValueError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got {layout.recompute!r}")
    if layout.schedule not in SCHEDULES:
        raise ValueError(f"--schedule {layout.schedule!r} is not priced; choose {', '.join(SCHEDULES)}")
    if layout.virtual > 1 and layout.schedule != "interleaved":
        raise ValueError("--virtual-stages > 1 needs --schedule interleaved")
    if global_batch % dp:
        raise ValueError(
            f"--global-batch {global_batch} is not divisible by dp {dp}: choose a multiple of {dp}"
        )
    if (global_batch // dp) % layout.micro_batch:
        raise ValueError(
            f"--micro-batch {layout.micro_batch} does not divide the per-rank batch "
            f"{global_batch // dp}: choose a divisor of it"
        )
    if pp > 1 and layout.schedule == "interleaved" and layout.micro_batches(global_batch) % pp:
        raise ValueError(
            f"interleaved needs micro-batches ({layout.micro_batches(global_batch)}) a multiple "
            f"of pp {pp}: change --micro-batch or --global-batch"
        )
