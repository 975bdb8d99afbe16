"""A mixture-of-experts GPT training step on 2 ranks: experts spread over them (``--ep 2``) vs replicated
(dp2), and ZeRO-3 on top of ep2, through the real trainer (``meshwise train gpt --profile``). With
``--nproc 4`` every layout runs twice as data parallel (ep2 is then ep2·dp2, and ZeRO-3 shards each expert
over the 2 ranks holding it).

The same MoE GPT (default: 2 layers, hidden 256, 4 heads, sequence 64, 8 experts, top-2, dropless unless
``--capacity-factor``), the same global batch, AdamW and data, on each ``--backend``:

- ``dp2``: every rank holds all E experts; DataParallel averages every gradient;
- ``ep2``: each rank holds E/2 experts; tokens travel to them by two all-to-alls per layer forward (counts,
  then tokens) and one back, and as many backward; dense gradients average over both ranks, expert
  gradients need no communication (each expert lives on one rank);
- ``zero3-ep2`` (``--layouts``): ep2 with ZeRO-3 — the dense weights, gradients and AdamW state sharded over
  both ranks (gathered per block), each rank's experts over the ranks that hold them (here: itself).

Each round runs one training job of ``--steps`` steps per layout (order alternating); a job's figure is
its median step's tokens/s (the trainer's own, the first step left out). The table gives medians over
rounds, the ratio to the first layout (paired by round), the per-rank model state (fp32 weights +
gradients + Adam's two moments = 16 bytes per parameter held, an exact count; under ZeRO the fullest
rank's bytes the run itself accounted from the tensors it holds), the activations saved for backward per
micro-batch (measured by ``--profile``) and, for ep2, the share of the profiled steps rank 0 spent in the
experts' dispatch and combine (all-to-alls of counts and tokens, forward and backward).

    python benchmarks/bench_moe.py --json benchmarks/results/ep_train_moe.json
    python benchmarks/bench_moe.py --layouts ep2,zero3-ep2 --json benchmarks/results/zero_ep_moe.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from meshwise.models.gpt import GPTConfig
from meshwise.parallel.expert_parallel import check_expert_parallel

STATE_BYTES_PER_PARAMETER = 16  # fp32 weight, gradient, Adam m and v
LAYOUTS = {"dp2": [], "ep2": ["--ep", "2"], "zero3-ep2": ["--ep", "2", "--zero", "3"]}
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def held_parameters(config: GPTConfig, ep: int) -> int:
    """Parameters one rank holds: the whole model, less the experts other ep ranks hold."""
    whole = config.num_parameters()
    expert = 8 * config.hidden**2 + 5 * config.hidden  # one expert: the plain MLP's fc and proj with biases
    return whole - config.layers * (config.experts - config.experts // ep) * expert


def accounted_state(notes: list[str]) -> float:
    """The fullest rank's model state from a ZeRO run's memory report (``rank r: ... (total X MiB)``)."""
    ranks = [line for line in notes if line.strip().startswith("rank ")]
    totals = [re.search(r"\(total ([\d.]+) (B|KiB|MiB|GiB)\)", line) for line in ranks]
    return max(float(m[1]) * UNITS[m[2]] for m in totals if m)


def run_job(args: argparse.Namespace, backend: str, layout: str, directory: str) -> dict:
    """One ``meshwise train gpt`` job of ``layout`` on ``--nproc`` ranks; its JSON result."""
    out = Path(directory) / f"{backend}-{layout}.json"
    command = [
        sys.executable, "-m", "meshwise", "train", "gpt", "-np", str(args.nproc), "--backend", backend,
        "--config", "gpt-moe-tiny", "--layers", str(args.layers), "--hidden", str(args.hidden),
        "--experts", str(args.experts), "--top-k", str(args.top_k), "--seq-len", str(args.seq_len),
        "--global-batch", str(args.nproc * args.batch), "--steps", str(args.steps),
        "--eval-every", str(args.steps), "--eval-windows", "2", "--warmup", "0", "--profile",
        "--json", str(out), *LAYOUTS[layout],
    ]  # fmt: skip
    if args.capacity_factor is not None:
        command += ["--capacity-factor", str(args.capacity_factor)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=None, help="default: dropless")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default 8)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2; 4: every layout × dp2)")
    parser.add_argument("--backend", default="gloo,shm", help="comma-separated backends (default gloo,shm)")
    parser.add_argument("--rounds", type=int, default=3, help="jobs per layout and backend (default 3)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per job (default 8)")
    parser.add_argument(
        "--layouts",
        default="dp2,ep2",
        help=f"comma-separated, of {', '.join(LAYOUTS)}; the first is the ratio's baseline (default dp2,ep2)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown or len(set(layouts)) != len(layouts):
        parser.error(f"--layouts takes distinct names of {', '.join(LAYOUTS)}, got {args.layouts}")
    baseline = layouts[0]
    try:
        check_expert_parallel(args.experts, 2)
        config = GPTConfig(
            layers=args.layers, hidden=args.hidden, heads=4, seq_len=args.seq_len, vocab=256,
            experts=args.experts, top_k=args.top_k, capacity_factor=args.capacity_factor,
        ).validate()  # fmt: skip
    except ValueError as exc:
        parser.error(str(exc))
    if args.nproc not in (2, 4):
        parser.error(f"--nproc takes 2 or 4 (ep2, alone or × dp2), got {args.nproc}")
    if args.steps < 2 or args.rounds < 1:
        parser.error("--steps must be at least 2 (the first step is left out) and --rounds at least 1")
    load = os.getloadavg()
    rows = []
    loads = " ".join(f"{value:.2f}" for value in load)
    print(f"MoE GPT training step, {args.nproc} ranks: {config}; load average {loads}")
    print(f"{'backend':<8} {'layout':<10} {'tokens/s':>10} {'vs ' + baseline:>13} {'state MiB/rank':>15} "
          f"{'act. MiB/mb':>12} {'dispatch+combine':>17}")  # fmt: skip
    with tempfile.TemporaryDirectory() as directory:
        for backend in args.backend.split(","):
            runs: dict[str, list[dict]] = {name: [] for name in layouts}
            for round_ in range(args.rounds):
                order = layouts if round_ % 2 == 0 else list(reversed(layouts))
                for name in order:
                    runs[name].append(run_job(args, backend, name, directory))
            rates = {name: [r["tokens_per_second"] for r in runs[name]] for name in layouts}
            for name in layouts:
                profiles = [r["profile"] for r in runs[name]]
                spread = "--ep" in LAYOUTS[name]
                share = statistics.median(p["expert_exchange_share"] for p in profiles) if spread else None
                if "--zero" in LAYOUTS[name]:  # accounted by the run; the same on every round
                    state = max(accounted_state(r["notes"]) for r in runs[name])
                else:
                    state = STATE_BYTES_PER_PARAMETER * held_parameters(config, 2 if spread else 1)
                activations = [sum(b["measured"] for b in p["activation_memory"]) for p in profiles]
                row = {
                    "backend": backend,
                    "layout": name,
                    "tokens_per_second": statistics.median(rates[name]),
                    "ratio_vs_baseline": statistics.median(
                        a / b for a, b in zip(rates[name], rates[baseline], strict=True)
                    ),
                    "state_bytes_per_rank": state,
                    "activation_bytes_per_micro_batch": statistics.median(activations),
                    "exchange_share": share,
                    "samples": rates[name],
                }
                rows.append(row)
                shown = f"{100 * share:16.1f}%" if share is not None else f"{'-':>17}"
                ratio = row["ratio_vs_baseline"]
                print(
                    f"{backend:<8} {name:<10} {row['tokens_per_second']:10,.0f} {ratio:13.2f} "
                    f"{row['state_bytes_per_rank'] / 2**20:15.1f} "
                    f"{row['activation_bytes_per_micro_batch'] / 2**20:12.2f} {shown}"
                )
    if args.json:
        result = {"config": vars(args), "model": config.__dict__, "load_average": load, "rows": rows}
        result["baseline"] = baseline
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
