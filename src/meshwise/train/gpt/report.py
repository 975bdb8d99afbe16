"""What a GPT run reports: one record per step (reduced over the ranks) and the final summary."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from meshwise.train.gpt.layer_memory import memory_lines
from meshwise.train.gpt.moe import expert_exchange_line
from meshwise.train.profile import table


@dataclass(frozen=True)
class StepStats:
    """One optimizer step: loss averaged over the global batch, throughput over all ranks."""

    step: int  # 1-based
    loss: float
    lr: float
    grad_norm: float
    seconds: float
    tokens: int  # tokens in the global batch
    val_loss: float | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class GPTResult:
    """The run as rank 0 saw it."""

    model: str
    parameters: int
    dataset: str
    world_size: int
    mesh: str
    backend: str
    device: str
    dtype: str
    global_batch: int
    micro_batch: int
    accumulation: int
    seq_len: int
    steps: int
    first_step: int  # 0, or the step a resumed run continued from
    initial_val_loss: float | None  # before any training
    history: tuple[StepStats, ...]
    flops_per_token: int
    peak_flops: float  # all ranks together
    peak_source: str
    wall_seconds: float
    checkpoint: str | None
    sample: str | None = None
    #: with --comm-stats: rank 0's calls, bytes and bus bytes per op on each mesh axis, over the run
    comm_stats: dict[str, dict[str, dict[str, float]]] | None = None
    exported: str | None = None  # the Hugging Face weights file --export-hf wrote
    #: the fullest rank's peak bytes during the steps above those before the model: allocated (what a
    #: plan predicts), setup_allocated (building and cutting the model), resident (see peak_memory)
    peak_memory: dict[str, int | None] | None = None
    #: with --profile: rank 0's step breakdown (profile.breakdown; under --pp also pipeline_idle_fraction)
    profile: dict | None = None
    #: the strategy's own summary lines (ZeRO: per-rank memory vs the formula, the fp16 loss scale)
    notes: tuple[str, ...] = ()
    #: how the work was split: ZeRO stage, sequence parallelism, pipeline schedule, virtual stages, …
    strategy: dict[str, Any] | None = None
    #: the files the run wrote besides --json (trace, timeline, torch profile, metrics), by flag
    outputs: dict[str, str] | None = None

    @property
    def trained(self) -> tuple[StepStats, ...]:
        return tuple(s for s in self.history if s.step > self.first_step)

    @property
    def tokens_per_second(self) -> float:
        """Median over this invocation's steps after the first (which pays for warm-up)."""
        rates = sorted(s.tokens_per_second for s in self.trained[1:] or self.trained)
        return rates[len(rates) // 2] if rates else 0.0

    @property
    def mfu(self) -> float:
        return self.tokens_per_second * self.flops_per_token / self.peak_flops if self.peak_flops else 0.0

    @property
    def val_losses(self) -> list[tuple[int, float]]:
        """(step, validation loss) pairs, step 0 being the untrained model."""
        start = [] if self.initial_val_loss is None else [(0, self.initial_val_loss)]
        return start + [(s.step, s.val_loss) for s in self.history if s.val_loss is not None]

    def summary(self) -> str:
        lines = ["", "===== GPT TRAINING SUMMARY ====="]
        lines.append(f"Model               = {self.model} ({self.parameters:,} parameters) on {self.dataset}")
        lines.append(
            f"Ranks               = {self.world_size} × {self.device} ({self.backend}), mesh {self.mesh}"
        )
        per_dp, m = self.micro_batch * self.accumulation, self.accumulation
        lines.append(
            f"Batch               = {self.global_batch} sequences × {self.seq_len} tokens per step; {per_dp} "
            f"per data-parallel rank in {m} micro-batch{'es' if m > 1 else ''} of {self.micro_batch}, "
            f"{self.dtype}"
        )
        if self.strategy:
            lines.append(f"Strategy            = {strategy_line(self.strategy)}")
        resumed = f", resumed after step {self.first_step}" if self.first_step else ""
        lines.append(f"Steps               = {len(self.trained)} run{resumed}, {self.steps} in total")
        if self.val_losses:
            first, last = self.val_losses[0], self.val_losses[-1]
            lines.append(
                f"Validation loss     = {last[1]:.4f} at step {last[0]} (was {first[1]:.4f} at step "
                f"{first[0]})"
            )
        lines.append(f"Final train loss    = {self.history[-1].loss:.4f}")
        lines.append(f"Throughput          = {self.tokens_per_second:,.0f} tokens/s (median step)")
        lines.append(
            f"MFU                 = {100 * self.mfu:.1f} % of {self.peak_flops / 1e9:,.1f} GFLOP/s "
            f"({self.peak_source} peak, all ranks)"
        )
        lines.append(f"Wall time           = {self.wall_seconds:.3f} s")
        if self.checkpoint:
            lines.append(f"Checkpoint          = {self.checkpoint}")
        if self.exported:
            lines.append(f"Hugging Face export = {self.exported}")
        for flag, path in (self.outputs or {}).items():
            lines.append(f"{flag:<20}= {path}")
        lines += self.notes
        if self.comm_stats:
            lines += self._comm_lines()
        if self.profile is not None:
            lines += ["", table(self.profile, gpt_knobs(self.strategy))]
            if "pipeline_idle_fraction" in self.profile:
                idle = self.profile["pipeline_idle_fraction"]
                lines.append(
                    f"pipeline bubble: {100 * idle:.1f} % of the pipeline's window idle (mean over its ranks)"
                )
            if self.profile.get("activation_memory"):
                lines += memory_lines(self.profile["activation_memory"])
            if "expert_exchange_share" in self.profile:
                lines.append(expert_exchange_line(self.profile))
        if self.sample is not None:
            lines += ["", "----- sample -----", self.sample, "------------------"]
        return "\n".join(lines)

    def _comm_lines(self) -> list[str]:
        """Rank 0's collectives per mesh axis: calls and MiB per training step (evaluation included)."""
        steps = max(1, len(self.trained))
        lines = [
            "",
            f"Communication (rank 0, per step of {steps}; bus MiB: link traffic, nccl-tests factors)",
        ]
        lines.append(f"  {'axis':<5}{'op':<16}{'calls':>9}{'MiB':>12}{'bus MiB':>12}")
        for axis, ops in (self.comm_stats or {}).items():
            for op, count in ops.items():
                mib, bus = count["bytes"] / steps / 2**20, count["bus_bytes"] / steps / 2**20
                lines.append(f"  {axis:<5}{op:<16}{count['calls'] / steps:>9.1f}{mib:>12.3f}{bus:>12.3f}")
        return lines

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["history"] = [asdict(s) | {"tokens_per_second": s.tokens_per_second} for s in self.history]
        data.update(
            tokens_per_second=self.tokens_per_second,
            mfu=self.mfu,
            final_val_loss=self.val_losses[-1][1] if self.val_losses else None,
        )
        if self.profile is not None and "verdict" in self.profile:  # the advice in train gpt's flags
            verdict = data["profile"]["verdict"]
            verdict["knob"] = gpt_knobs(self.strategy)[verdict["bound"]]
        return data


#: what to change when a part bounds the step, in ``train gpt``'s own flags (the generic advice names
#: knobs of other commands: DataParallel buckets, DataLoader workers)
GPT_KNOBS = {
    "communication": "send less or overlap more: a larger per-rank batch (--global-batch), --zero 1 or 2 "
    "rather than 3, a smaller --tp, a faster --backend (shm on one host, nccl on GPUs), or fewer ranks (-np)",
    "data": "batches come from memory here; give --data as a .bin token file to skip decoding text",
    "bubble": "shrink the pipeline bubble: more --micro-batches per step (m >> pp), or --schedule "
    "interleaved --virtual-stages 2, or --schedule zb",
    "other": "host overhead between phases (evaluation, logging, metric syncs): raise --eval-every / "
    "--log-every, drop --comm-stats",
    "compute": "compute dominates, as it should: add ranks (-np), use --device cuda, or --dtype bf16",
}


def gpt_knobs(strategy: dict[str, Any] | None) -> dict[str, str]:
    """:data:`GPT_KNOBS` for this run: the bubble advice names only the schedules it does not already use
    (a zb run is not told to try zb; an interleaved one is told to raise --virtual-stages)."""
    run = strategy or {}
    schedule = run.get("schedule")
    if schedule not in ("zb", "interleaved"):
        return GPT_KNOBS
    other = (
        "--schedule interleaved --virtual-stages 2"
        if schedule == "zb"
        else f"more --virtual-stages (now {run.get('virtual_stages', 1)}), or --schedule zb"
    )
    bubble = f"shrink the pipeline bubble: more --micro-batches per step (m >> pp), or {other}"
    return GPT_KNOBS | {"bubble": bubble}


def strategy_line(strategy: dict[str, Any]) -> str:
    """``ZeRO-2 over dp 2, tp 2 with sequence parallelism, pp 2 (1f1b, 4 micro-batches)``."""
    cp = strategy.get("cp", 1)
    replicas = f"dp {strategy['dp']} × cp {cp}" if cp > 1 else f"dp {strategy['dp']}"  # ZeRO shards over both
    parts = [f"ZeRO-{strategy['zero']} over {replicas}" if strategy["zero"] else f"dp {strategy['dp']}"]
    if strategy.get("ep", 1) > 1:  # ep ranks are among the data ranks counted in dp
        parts.append(f"experts over ep {strategy['ep']} of them")
        if strategy["zero"]:  # ZeRO shards an expert over the ranks that hold it: dp/ep (× cp)
            held = strategy["dp"] // strategy["ep"]
            parts[-1] += f", each ZeRO-sharded over dp {held}{f' × cp {cp}' if cp > 1 else ''}"
    if strategy["tp"] > 1:
        parts.append(f"tp {strategy['tp']}{' with sequence parallelism' if strategy['sp'] else ''}")
    if cp > 1:
        parts.append(f"cp {cp} (each sequence in {2 * cp} chunks)")
    if strategy["pp"] > 1:
        virtual = f", {strategy['virtual_stages']} virtual stages" if strategy["virtual_stages"] > 1 else ""
        m = strategy["micro_batches"]
        parts.append(f"pp {strategy['pp']} ({strategy['schedule']}, {m} micro-batches{virtual})")
    return ", ".join(parts)


def step_line(stats: StepStats, steps: int, mfu: float) -> str:
    val = f"  val {stats.val_loss:.4f}" if stats.val_loss is not None else ""
    return (
        f"step {stats.step:>{len(str(steps))}}/{steps}  loss {stats.loss:.4f}{val}  lr {stats.lr:.2e}  "
        f"|g| {stats.grad_norm:.2f}  {stats.tokens_per_second:8,.0f} tok/s  MFU {100 * mfu:4.1f}%"
    )
