"""What ``meshwise plan`` prints and writes: the inputs, the ZeRO model-state table, the winner's memory
and time breakdowns, the ranking, one line per rejected neighbour; JSON; and the plot (memory bars of the
top layouts, predicted scaling curve)."""

from __future__ import annotations

from collections.abc import Sequence

from meshwise.plan.hardware import GB, GIB
from meshwise.plan.memory import model_states
from meshwise.plan.search import Candidate, Plan, Problem

#: memory kinds in the order the breakdown prints them
MEMORY_KINDS = (
    "parameters",
    "gradients",
    "optimizer",
    "activations",
    "logits",
    "gather_buffers",
    "comm_buckets",
    "after_step",
    "released",
    "reserved",
)


def count(n: float) -> str:
    """7.500 B, 10.7 M, 220.5 K."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:,.3f} {unit}" if unit == "B" else f"{n / scale:,.1f} {unit}"
    return f"{n:.0f}"


def size(nbytes: float) -> str:
    """Decimal units as the ZeRO paper writes them: 120.0 GB, 31.4 GB, 3.5 MB."""
    for unit, scale in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def zero_line(problem: Problem) -> str:
    """The ZeRO paper's Figure 1 for this model: model states per GPU with all GPUs data parallel."""
    n, psi, prec = problem.gpus, problem.model.parameters, problem.precision
    per_param = f"{prec.value}+{prec.value}+{prec.optimizer_bytes}"
    stages = " · ".join(
        f"{name} {size(sum(model_states(psi, n, stage, prec)))}"
        for stage, name in enumerate(("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"))
    )
    return f"Model states per GPU, {n}-way data parallel ({per_param} bytes/parameter): {stages}"


def header(problem: Problem) -> list[str]:
    c, hw = problem.model.config, problem.hardware
    return [
        f"Model     {count(problem.model.parameters)} parameters: {c.layers} layers, "
        f"hidden {c.hidden}, "
        f"{c.heads} heads, vocab {c.vocab}, seq {c.seq_len}",
        f"Hardware  {problem.gpus} × {hw.name} ({hw.source}): {hw.peak(problem.precision.dtype) / 1e12:,.1f} "
        f"TFLOP/s {problem.precision.dtype}, {hw.memory / GIB:,.1f} GiB, {hw.per_node} per node, intra "
        f"{hw.intra.bandwidth / GB:,.0f} GB/s, inter {hw.inter.bandwidth / GB:,.0f} GB/s",
        f"Training  global batch {problem.global_batch} × {c.seq_len} tokens, {problem.precision.dtype}, "
        f"{problem.precision.optimizer}",
        zero_line(problem),
    ]


def breakdown(candidate: Candidate, tokens: float) -> list[str]:
    m, t = candidate.memory, candidate.time
    lines = [
        f"Memory per GPU (fullest rank): {m.total / GIB:,.2f} GiB of {m.capacity / GIB:,.1f} — {m.verdict()}"
    ]
    lines += [f"  {kind.replace('_', ' '):<15}{getattr(m, kind) / GIB:>10,.3f} GiB" for kind in MEMORY_KINDS]
    lines.append(f"Step time: {t.step:,.4g} s")
    lines += [
        f"  {cause.replace('_', ' '):<15}{seconds:>10,.4g} s  {100 * seconds / t.step:5.1f} %"
        for cause, seconds in t.causes().items()
    ]
    lines.append(
        f"  {t.tokens_per_second:,.0f} tokens/s, MFU {100 * t.mfu:.1f} %, HFU {100 * t.hfu:.1f} %, "
        f"{t.days(tokens):,.1f} days for {tokens:.3g} tokens"
    )
    return lines


def render(plan: Plan, tokens: float, top: int = 10) -> str:
    """The whole human report as text (rich renders the ranking as a table when printing)."""
    lines = [*header(plan.problem), ""]
    best = plan.best
    if best is None:
        return "\n".join([*lines, "No layout can run this model on these GPUs (see the flags' constraints)."])
    if not best.fits:
        lines.append(f"No layout fits: the smallest, {best.layout.name()}, is {best.memory.verdict()}.")
    else:
        lines.append(
            f"Best of {len(plan.ranked)} layouts that fit ({plan.rejected} do not): {best.layout.name()}"
        )
    lines += [*breakdown(best, tokens), "", ranking_text(plan.ranked[:top]), "", "Neighbours of the winner:"]
    lines += [f"  {layout.name():<40} {why}" for layout, why in plan.neighbours]
    return "\n".join(lines)


def ranking_rows(candidates: Sequence[Candidate]) -> list[tuple[str, ...]]:
    return [
        (
            str(i),
            c.layout.name(),
            f"{c.memory.total / GIB:,.2f}",
            f"{c.time.step:,.4g}",
            f"{c.time.tokens_per_second:,.0f}",
            f"{100 * c.time.mfu:.1f}",
        )
        for i, c in enumerate(candidates, 1)
    ]


RANKING_COLUMNS = ("#", "layout", "GiB/GPU", "step s", "tokens/s", "MFU %")


def ranking_text(candidates: Sequence[Candidate]) -> str:
    rows = [RANKING_COLUMNS, *ranking_rows(candidates)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(RANKING_COLUMNS))]
    return "\n".join(
        "  ".join(
            cell.rjust(w) if i != 1 else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    )


def to_json(plan: Plan, tokens: float, top: int = 20) -> dict:
    p = plan.problem
    return {
        "model": {"parameters": p.model.parameters, **vars(p.model.config)},
        "hardware": {
            "name": p.hardware.name,
            "source": p.hardware.source,
            "peak_flops": p.hardware.peak_flops,
            "memory": p.hardware.memory,
            "per_node": p.hardware.per_node,
        },
        "gpus": p.gpus,
        "global_batch": p.global_batch,
        "precision": {"dtype": p.precision.dtype, "optimizer": p.precision.optimizer},
        "zero_model_states": {
            stage: sum(model_states(p.model.parameters, p.gpus, stage, p.precision)) for stage in range(4)
        },
        "tokens": tokens,
        "fitting": len(plan.ranked),
        "rejected": plan.rejected,
        "best": plan.best.to_json() if plan.best else None,
        "ranked": [c.to_json() for c in plan.ranked[:top]],
        "neighbours": [{"name": layout.name(), "why": why} for layout, why in plan.neighbours],
    }


def plot(plan: Plan, scaling: Sequence[tuple[int, float | None]], path: str, top: int = 8) -> None:
    """Left: stacked memory bars of the top layouts (and the capacity line); right: the best predicted
    tokens/s at each GPU count of ``scaling`` (None where nothing fits), against linear scaling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    shown = plan.ranked[:top] or ([plan.best] if plan.best else [])
    bottoms = [0.0] * len(shown)
    for kind in (k for k in MEMORY_KINDS if k != "released"):  # bars stack what is held
        values = [getattr(c.memory, kind) / GIB for c in shown]
        left.bar(range(len(shown)), values, bottom=bottoms, label=kind.replace("_", " "))
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    left.axhline(plan.problem.hardware.memory / GIB, color="black", linestyle="--", label="capacity")
    left.set_xticks(range(len(shown)), [c.layout.name() for c in shown], rotation=30, ha="right", fontsize=7)
    left.set_ylabel("GiB per GPU")
    left.set_title("Memory of the top layouts")
    left.legend(fontsize=7)
    points = [(n, r) for n, r in scaling if r is not None]
    if points:
        gpus, rates = zip(*points, strict=True)
        right.plot(gpus, rates, "o-", label="predicted (best layout at each size)")
        right.plot(gpus, [rates[0] * n / gpus[0] for n in gpus], ":", label="linear")
        right.set_xscale("log", base=2)
        right.set_yscale("log")
    right.set_xlabel("GPUs")
    right.set_ylabel("tokens/s")
    right.set_title("Predicted scaling")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
