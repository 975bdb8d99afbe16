"""The advisor: every layout of the GPUs that can run the model, priced, ranked, and explained.

The search walks dp·tp·pp·cp·ep = GPUs (tp a divisor of the heads, pp of at most the layers, ep a divisor
of a mixture of experts' E, cp as given by ``--cp``), ZeRO 0–3,
micro-batches (powers of two dividing the per-rank batch), schedules (1F1B, interleaved with two chunks
per rank, GPipe) and recomputation (none, selective, full); sequence parallelism is on whenever tp > 1
(same bytes on the wire, 1/t of the replicated activations). Any dimension the user fixed is not
searched. Layouts that fit are ranked by predicted step time; the winner's *neighbours* (one dimension
changed) are explained in one line each: why they do not fit, or what they lose time on.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

from meshwise.models.gpt_shape import GPTConfig
from meshwise.plan.hardware import GIB, Hardware
from meshwise.plan.layout import RECOMPUTE, Layout, check
from meshwise.plan.memory import MemoryEstimate, Precision, estimate_memory
from meshwise.plan.model import ModelSpec
from meshwise.plan.step_time import TimeEstimate, estimate_time

#: most micro-batch sizes tried per layout (powers of two from 1)
MAX_MICRO_BATCH = 64


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    time: TimeEstimate

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def to_json(self) -> dict:
        layout = {f.name: getattr(self.layout, f.name) for f in fields(Layout)}
        return {
            "layout": layout,
            "name": self.layout.name(),
            "memory": self.memory.to_json(),
            "time": self.time.to_json(),
        }


@dataclass(frozen=True)
class Problem:
    """What is planned: the model, the machine, the precision, the batch, the GPUs."""

    model: ModelSpec
    hardware: Hardware
    precision: Precision
    global_batch: int
    gpus: int
    attention: str = "flash"  # the GPU kernel; the CPU's SDPA without dropout saves the same
    mask_bytes: int = 0  # per dropout-mask element; 0: no dropout (our GPT configs)

    def memory(self, layout: Layout) -> MemoryEstimate:
        return estimate_memory(
            self.model,
            layout,
            self.hardware,
            self.precision,
            self.global_batch,
            attention=self.attention,
            mask_bytes=self.mask_bytes,
        )

    def price(self, layout: Layout, memory: MemoryEstimate | None = None) -> Candidate:
        """Memory and time of ``layout``; ValueError (one line) when it cannot run the model."""
        check(layout, self.model.config, self.gpus, self.global_batch)
        memory = memory or self.memory(layout)
        return Candidate(
            layout,
            memory,
            estimate_time(self.model, layout, self.hardware, self.precision, self.global_batch),
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(problem: Problem, fixed: dict[str, object]) -> Iterator[Layout]:
    """Every layout the search considers that ``check`` accepts, ``fixed`` dimensions held."""
    c, gpus, batch = problem.model.config, problem.gpus, problem.global_batch
    for tp, pp, cp, ep in _axes(c, gpus, fixed):
        dp = gpus // (tp * pp * cp * ep)
        if fixed.get("dp", dp) != dp or batch % (dp * ep):
            continue
        for layout in _choices(c, batch, fixed, Layout(dp, tp, pp, sp=fixed.get("sp", tp > 1), cp=cp, ep=ep)):
            try:
                check(layout, c, gpus, batch)
            except ValueError:
                continue
            yield layout


def _axes(c: GPTConfig, gpus: int, fixed: dict[str, object]) -> Iterator[tuple[int, int, int, int]]:
    """tp (a divisor of the heads), pp (of at most the layers), cp (as given: priced, not searched —
    splitting sequences pays off only where their activations do not fit, which the memory model says
    of a given --cp), ep (a divisor of the experts, searched for a mixture of experts)."""
    cp = int(fixed.get("cp", 1))  # type: ignore[call-overload]
    for tp in [fixed["tp"]] if "tp" in fixed else [d for d in _divisors(c.heads) if gpus % d == 0]:
        for pp in [fixed["pp"]] if "pp" in fixed else [d for d in _divisors(gpus // tp) if d <= c.layers]:
            if gpus % (tp * pp * cp):
                continue
            rest = gpus // (tp * pp * cp)
            experts = [d for d in _divisors(rest) if c.experts % d == 0] if c.experts else [1]
            for ep in [fixed["ep"]] if "ep" in fixed else experts:
                if rest % ep == 0:
                    yield tp, pp, cp, ep


def _choices(c: GPTConfig, batch: int, fixed: dict[str, object], axes: Layout) -> Iterator[Layout]:
    """ZeRO stage, micro-batch, schedule and recomputation for the rank axes of ``axes``."""
    dp, pp = axes.dp, axes.pp
    per_rank = batch // axes.batch_ranks
    largest = min(per_rank, MAX_MICRO_BATCH)
    powers = [b for b in (2**i for i in range(7)) if b <= largest and per_rank % b == 0]
    micro = [fixed["micro_batch"]] if "micro_batch" in fixed else powers
    schedules = [("1f1b", 1)]
    if pp > 1:
        schedules = [("1f1b", 1), ("gpipe", 1)] + ([("interleaved", 2)] if c.layers >= 2 * pp else [])
    if "schedule" in fixed:
        wanted = fixed["schedule"]
        schedules = [(wanted, 2 if wanted == "interleaved" else 1)]
    for zero in [fixed["zero"]] if "zero" in fixed else ([0, 1, 2, 3] if dp > 1 else [0]):
        for b in micro:
            for schedule, v in schedules:
                for recompute in [fixed["recompute"]] if "recompute" in fixed else RECOMPUTE:
                    yield replace(
                        axes, zero=zero, micro_batch=b, schedule=schedule, virtual=v, recompute=recompute
                    )


@dataclass(frozen=True)
class Plan:
    problem: Problem
    ranked: tuple[Candidate, ...]  # layouts that fit, fastest first
    rejected: int  # layouts priced that do not fit
    neighbours: tuple[tuple[Layout, str], ...]  # the winner's, one line each

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None


def advise(problem: Problem, fixed: dict[str, object] | None = None) -> Plan:
    """Price every layout, rank those that fit, explain the winner's neighbours."""
    fixed = fixed or {}
    fitting, rejected, smallest = [], 0, None
    for layout in layouts(problem, fixed):
        memory = problem.memory(layout)  # cheap: time is priced only for what fits
        if memory.fits:
            fitting.append(
                Candidate(
                    layout,
                    memory,
                    estimate_time(
                        problem.model, layout, problem.hardware, problem.precision, problem.global_batch
                    ),
                )
            )
        else:
            rejected += 1
            if smallest is None or memory.total < smallest[1].total:
                smallest = (layout, memory)
    fitting.sort(key=lambda c: (c.time.step, c.memory.total))
    winner = fitting[0] if fitting else (problem.price(*smallest) if smallest else None)
    notes = tuple(explain_neighbours(problem, winner)) if winner is not None else ()
    return Plan(problem, tuple(fitting), rejected, notes)


def neighbours(layout: Layout) -> Iterator[Layout]:
    """Layouts one step away: tp or pp doubled/halved against dp, ZeRO ±1, micro-batch ×2 / ÷2, the other
    recomputation modes and schedules."""
    gpus = layout.gpus
    for tp, pp in (
        (layout.tp * 2, layout.pp),
        (layout.tp // 2, layout.pp),
        (layout.tp, layout.pp * 2),
        (layout.tp, layout.pp // 2),
    ):
        if tp >= 1 and pp >= 1 and gpus % (tp * pp) == 0:
            yield replace(
                layout,
                tp=tp,
                pp=pp,
                dp=gpus // (tp * pp),
                zero=layout.zero if gpus // (tp * pp) > 1 else 0,
                sp=tp > 1 and (layout.sp or layout.tp == 1),
                schedule=layout.schedule if pp > 1 else "1f1b",
                virtual=layout.virtual if pp > 1 else 1,
            )
    for zero in (layout.zero - 1, layout.zero + 1):
        if 0 <= zero <= 3 and layout.dp > 1:
            yield replace(layout, zero=zero)
    for b in (layout.micro_batch * 2, layout.micro_batch // 2):
        if b >= 1:
            yield replace(layout, micro_batch=b)
    for recompute in RECOMPUTE:
        if recompute != layout.recompute:
            yield replace(layout, recompute=recompute)
    if layout.pp > 1:
        for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2)):
            if schedule != layout.schedule:
                yield replace(layout, schedule=schedule, virtual=v)


def explain_neighbours(problem: Problem, winner: Candidate) -> Iterator[tuple[Layout, str]]:
    for layout in neighbours(winner.layout):
        try:
            other = problem.price(layout)
        except ValueError as exc:
            yield layout, f"cannot run: {exc}"
            continue
        if not other.fits:
            yield layout, out_of_memory(winner.memory, other.memory)
            continue
        yield layout, compare(winner, other)


def out_of_memory(winner: MemoryEstimate, other: MemoryEstimate) -> str:
    """ "out of memory by 1.3 GiB: activations +2.0 GiB" — the kind that grew most against the winner."""
    kinds = [k for k in vars(other) if k not in ("capacity", "reserved", "released")]
    grown = max(kinds, key=lambda k: getattr(other, k) - getattr(winner, k))
    delta = getattr(other, grown) - getattr(winner, grown)
    short = (other.total - other.capacity) / GIB
    return f"out of memory by {short:.1f} GiB: {grown.replace('_', ' ')} +{delta / GIB:.1f} GiB"


def compare(winner: Candidate, other: Candidate) -> str:
    """``other`` against ``winner`` in one line: how much slower, and the cause that grew the most."""
    ratio = other.time.step / winner.time.step
    deltas = {k: other.time.causes()[k] - v for k, v in winner.time.causes().items()}
    cause = max(deltas, key=deltas.__getitem__)
    if ratio <= 1:
        return f"{(1 - ratio) * 100:.1f} % faster but the winner needs less memory" if ratio < 1 else "ties"
    share = deltas[cause] / winner.time.step * 100
    return f"{(ratio - 1) * 100:.1f} % slower: {cause.replace('_', ' ')} +{share:.1f} % of the step"
