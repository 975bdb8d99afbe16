"""busbw against message size, one panel per collective, one line per backend/algorithm (PNG).

Bus bandwidth is the figure that compares across collectives and rank counts and against the hardware
(nccl-tests' rationale), so it is what we draw — the out-of-place figure, nccl-tests' first — with sizes
on a log-2 axis. Two ceilings are drawn when
known: the link bandwidth a user states (``--ceiling``, e.g. a NIC's or NVLink's GB/s per direction),
and, with a calibration of this machine, the busbw the α-β-γ model predicts for each algorithm (dashed,
same colour) plus its asymptote 1/β, both from the calibration's entry for the run's world size
(``Calibration.for_world``). A measured curve far below its model curve is the interesting case.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshwise.bench.busbw import bus_factor
from meshwise.bench.runner import Row, RunResult
from meshwise.bench.sizes import format_size
from meshwise.comm.algorithms.registry import predict_seconds
from meshwise.comm.cost import Calibration


def _model_busbw(run: RunResult, rows: Sequence[Row], calibration: Calibration) -> list[float] | None:
    """Predicted busbw (GB/s) per row of ``rows``, or None when the model has no formula for this run."""
    world = calibration.for_world(run.world_size)
    link = world.native if run.algorithm == "native" else world.intra
    factor = bus_factor(run.collective, run.world_size)
    try:
        seconds = [
            predict_seconds(run.collective, run.algorithm, r.size, run.world_size, link) for r in rows
        ]
    except (KeyError, ValueError):  # sendrecv, auto, hierarchical: no single-link formula
        return None
    return [
        r.size / s / 1e9 * factor if s > 0 else float("nan") for r, s in zip(rows, seconds, strict=True)
    ]


def plot_runs(
    runs: Sequence[RunResult],
    path: str,
    *,
    ceiling_gbps: float | None = None,
    calibration: Calibration | None = None,
    title: str = "",
) -> None:
    """Write the PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    collectives = list(dict.fromkeys(run.collective for run in runs))
    if not collectives:
        raise ValueError("nothing to plot: no run produced rows")
    columns = min(3, len(collectives))
    rows = -(-len(collectives) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.4 * columns, 4.4 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, collective in zip(axes.flat, collectives, strict=False):
        mine = [run for run in runs if run.collective == collective and run.rows]
        for i, run in enumerate(mine):
            colour = colours[i % len(colours)]
            moved = [r for r in run.rows if r.count > 0]  # a count-0 row has no place on a log axis
            sizes = [r.size for r in moved]
            ax.plot(
                sizes,
                [r.out_of_place.busbw for r in moved],
                marker="o",
                ms=3,
                color=colour,
                label=f"{run.backend}/{run.algorithm}",
            )
            if calibration is not None:
                model = _model_busbw(run, moved, calibration)
                if model is not None:
                    ax.plot(
                        sizes,
                        model,
                        linestyle="--",
                        color=colour,
                        alpha=0.7,
                        label=f"{run.backend}/{run.algorithm} α-β-γ model",
                    )
        n = mine[0].world_size if mine else 0
        intra = calibration.for_world(n).intra if calibration is not None and n else None
        if intra is not None and intra.beta > 0:
            ax.axhline(
                1e-9 / intra.beta,
                color="grey",
                linestyle=":",
                label=f"1/β intra = {1e-9 / intra.beta:.2f} GB/s",
            )
        if ceiling_gbps is not None:
            ax.axhline(ceiling_gbps, color="black", linestyle="-.", label=f"link {ceiling_gbps:g} GB/s")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_size(round(x)) if x >= 1 else ""))
        ax.set_xlabel("size (bytes, nccl-tests S)")
        ax.set_ylabel("busbw (GB/s, out of place)")
        ax.set_title(f"{collective} · {n} rank{'' if n == 1 else 's'}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(collectives) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
