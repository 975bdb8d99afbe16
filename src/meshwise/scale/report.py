"""Present a scaling study: the seeds' table, a JSON record and a plot with ideal and model lines."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from meshwise.scale.metrics import BANDS, ScalePoint


def format_table(mode: str, points: Sequence[ScalePoint], unit: str = "Ranks") -> str:
    """Strong: ranks, wall time, speedup, efficiency (as the seeds print them); weak: scaled efficiency."""
    if mode == "strong":
        header = f"{unit:<6}  {'Wall time (s)':>13}  {'Speedup':>8}  {'Parallel efficiency':>19}  Serial frac"
    else:
        header = f"{unit:<6}  {'Wall time (s)':>13}  {'Scaled speedup':>14}  {'Weak efficiency':>15}"
    lines = [header + "  Rating"]
    for p in points:
        if mode == "strong":
            serial = "-" if p.serial_fraction is None else f"{p.serial_fraction:.4f}"
            row = f"{p.ranks:<6}  {p.wall_seconds:>13.6f}  {p.speedup:>8.4f}  {p.efficiency:>19.4f}"
            row += f"  {serial:>11}"
        else:
            row = f"{p.ranks:<6}  {p.wall_seconds:>13.6f}  {p.speedup:>14.4f}  {p.efficiency:>15.4f}"
        lines.append(f"{row}  {p.rating}")
    causes = [f"  n={p.ranks}: {'; '.join(p.causes)}" for p in points if p.causes]
    if causes:
        lines += ["", "Likely causes below 95 % efficiency:", *causes]
    return "\n".join(lines)


def to_json(
    *,
    workload: str,
    mode: str,
    cores: int,
    work: int | None,
    time_source: str,
    points: Sequence[ScalePoint],
    model: Sequence[float] | None,
) -> dict[str, Any]:
    """A machine-readable record of the study (every repeat kept, medians and verdicts per scale)."""
    return {
        "workload": workload,
        "mode": mode,
        "cores": cores,
        "work": work,
        "time_source": time_source,
        "bands": {name: floor for floor, name in BANDS},
        "points": [
            {**asdict(p), "times": list(p.times), "causes": list(p.causes), "model_seconds": m}
            for p, m in zip(points, model or [None] * len(points), strict=True)
        ],
    }


def write_json(path: str, record: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=2)
        handle.write("\n")


def plot(
    path: str, mode: str, points: Sequence[ScalePoint], model: Sequence[float] | None, title: str
) -> None:
    """Time and efficiency against ranks: log-log time for strong scaling, log-x for weak."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [p.ranks for p in points]
    times = [p.wall_seconds for p in points]
    base = points[0]
    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax_t.plot(ranks, times, "o-", label="measured (median)")
    for p in points:
        ax_t.scatter([p.ranks] * len(p.times), p.times, s=8, color="grey", alpha=0.6)
    ideal = [base.wall_seconds * base.ranks / r if mode == "strong" else base.wall_seconds for r in ranks]
    ax_t.plot(ranks, ideal, "k--", label="ideal")
    if model is not None:
        ax_t.plot(ranks, model, ":", color="tab:red", label="α-β-γ model")
    ax_t.set_xscale("log", base=2)
    ax_t.set_xticks(ranks, [str(r) for r in ranks])
    if mode == "strong":
        ax_t.set_yscale("log")
    ax_t.set_xlabel("ranks")
    ax_t.set_ylabel("wall time (s)")
    ax_t.legend()
    ax_e.plot(ranks, [p.efficiency for p in points], "o-", label="measured")
    ax_e.axhline(1.0, color="k", linestyle="--", label="ideal")
    shades = {"excellent": "tab:green", "good": "tab:olive", "acceptable": "tab:orange", "poor": "tab:red"}
    upper = 1.05
    for floor, name in BANDS:
        ax_e.axhspan(floor, upper, color=shades[name], alpha=0.08)
        upper = floor
    ax_e.set_xscale("log", base=2)
    ax_e.set_xticks(ranks, [str(r) for r in ranks])
    ax_e.set_ylim(0, max(1.05, 1.05 * max(p.efficiency for p in points)))  # superlinear points stay visible
    ax_e.set_xlabel("ranks")
    ax_e.set_ylabel("parallel efficiency" if mode == "strong" else "weak efficiency T(1)/T(n)")
    ax_e.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
