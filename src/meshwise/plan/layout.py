"""One way to lay a training step on the GPUs: dp·tp·pp, ZeRO stage, micro-batch, schedule, recomputation.

:func:`check` says in one line why a layout cannot run a model at all (sizes that do not divide); whether
it *fits* is the memory model's business. The pipeline quantities here — micro-batch activations each
schedule keeps in flight on its busiest rank (the first), and the idle fraction — are closed forms that
the tests check against :mod:`meshwise.parallel.pipeline_parallel.simulator` on every small case.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshwise.models.gpt_shape import GPTConfig
from meshwise.parallel.pipeline_bubble import theoretical_bubble

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
    cp: int = 1  # context parallelism: each sequence split over cp ranks (2·cp chunks)
    ep: int = 1  # expert parallelism: E/ep experts per rank; ep ranks read their own sequences

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp * self.ep

    @property
    def batch_ranks(self) -> int:
        """Ranks that read different sequences: dp, and ep (carved from the data-parallel ranks)."""
        return self.dp * self.ep

    @property
    def replicas(self) -> int:
        """Ranks holding the same dense parameters, whose gradients are summed: dp · ep · cp."""
        return self.dp * self.ep * self.cp

    def micro_batches(self, global_batch: int) -> int:
        """Micro-batches per rank per step (gradient accumulation, or the pipeline's m)."""
        return global_batch // (self.batch_ranks * self.micro_batch)

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
        """Short label: ``dp8·tp2·pp4 z1 mb2 interleaved×2 sel sp`` (``·cp2``, ``·ep2`` where used)."""
        axes = f"dp{self.dp}·tp{self.tp}·pp{self.pp}"
        axes += (f"·cp{self.cp}" if self.cp > 1 else "") + (f"·ep{self.ep}" if self.ep > 1 else "")
        parts = [axes]
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
    dp, tp, pp, cp, ep = layout.dp, layout.tp, layout.pp, layout.cp, layout.ep
    if min(dp, tp, pp, cp, ep, layout.micro_batch, layout.virtual) < 1:
        raise ValueError(f"{layout.name()}: sizes must be at least 1")
    if layout.gpus != gpus:
        raise ValueError(
            f"dp {dp} × tp {tp} × pp {pp} × cp {cp} × ep {ep} = {layout.gpus}, not the {gpus} GPUs: make "
            "the product equal --gpus"
        )
    if model.heads % tp:
        raise ValueError(
            f"--tp {tp} does not divide the {model.heads} attention heads: choose a divisor of {model.heads}"
        )
    if layout.sp and tp == 1:
        raise ValueError("sequence parallelism needs --tp 2 or more")
    if layout.sp and model.seq_len % tp:
        raise ValueError(f"--seq-len {model.seq_len} is not divisible by --tp {tp} (sequence parallelism)")
    if model.seq_len % (2 * cp):
        raise ValueError(
            f"--seq-len {model.seq_len} is not divisible by 2·cp = {2 * cp} (context parallelism's chunks): "
            f"choose a multiple of {2 * cp} or another --cp"
        )
    if layout.sp and cp > 1 and (model.seq_len // cp) % tp:
        raise ValueError(f"--seq-len / cp = {model.seq_len // cp} is not divisible by --tp {tp} (sp)")
    if ep > 1 and not model.experts:
        raise ValueError(f"--ep {ep} needs a mixture of experts: give --experts E (a multiple of {ep})")
    if model.experts and model.experts % ep:
        raise ValueError(f"--experts {model.experts} is not divisible by --ep {ep}: choose a divisor")
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
    batch, ranks = layout.batch_ranks, "dp" if ep == 1 else "dp·ep"
    if global_batch % batch:
        raise ValueError(
            f"--global-batch {global_batch} is not divisible by {ranks} {batch}: choose a multiple of {batch}"
        )
    if (global_batch // batch) % layout.micro_batch:
        raise ValueError(
            f"--micro-batch {layout.micro_batch} does not divide the per-rank batch "
            f"{global_batch // batch}: choose a divisor of it"
        )
    if pp > 1 and layout.schedule == "interleaved" and layout.micro_batches(global_batch) % pp:
        raise ValueError(
            f"interleaved needs micro-batches ({layout.micro_batches(global_batch)}) a multiple "
            f"of pp {pp}: change --micro-batch or --global-batch"
        )
