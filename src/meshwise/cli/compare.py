"""meshwise compare LAYOUT...: train each layout K steps from one seed and compare with one process.

Each layout (``dp2``, ``tp2``, ``pp2,m=4``, ``zero3``, ``dp2,tp2,sp`` …) runs ``meshwise train gpt`` with
the same model, seed (initial weights and token order), global batch and learning rate as a one-process
reference. Printed: per step the |Δloss| of every layout, the first step and the first parameter (after
the K steps, from the exported weights) that differ beyond --tol, and pass/fail. Exit 0 when all pass.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from meshwise.cli import summary
from meshwise.cli.outputs import check_output, write_outputs
from meshwise.train.compare import DEFAULT_TOLERANCE, compare_runs, parse_layout, table
from meshwise.train.trial import TrialSpec, run_trial


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(name, help=help_text, description=summary(__doc__))
    parser.add_argument("layouts", nargs="+", metavar="LAYOUT", help="e.g. dp2 tp2 pp2,m=4 zero3 dp2,tp2,sp")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (default %(default)s)")
    parser.add_argument("--config", default="gpt-tiny", help="named GPT (default %(default)s)")
    parser.add_argument(
        "-np",
        "--np",
        dest="ranks",
        type=int,
        default=2,
        help="ranks of a layout that names no dp (default %(default)s)",
    )
    parser.add_argument(
        "--global-batch", type=int, default=8, help="sequences per step (default %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tol", type=float, default=DEFAULT_TOLERANCE, help="largest |Δ| that passes")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run (default %(default)s)")
    parser.add_argument("--json", default=None, metavar="FILE|-", help="write the comparison as JSON")
    parser.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    try:
        check_output("--json", args.json)
        if args.steps < 1 or args.ranks < 1 or not args.tol > 0:
            raise ValueError("--steps and --np must be at least 1 and --tol positive")
        layouts = [(text, *parse_layout(text, args.ranks)) for text in args.layouts]
    except ValueError as exc:
        print(f"meshwise compare: error: {exc}", file=sys.stderr)
        return 2

    def spec(ranks: int, layout: dict) -> TrialSpec:
        return TrialSpec(
            ranks,
            layout,
            config=args.config,
            steps=args.steps,
            global_batch=args.global_batch,
            seed=args.seed,
            export=True,
        )

    with tempfile.TemporaryDirectory(prefix="meshwise-compare-") as scratch:
        work = Path(scratch)
        reference = run_trial(spec(1, {}), work, args.timeout)
        if not reference.ok:
            print(
                f"meshwise compare: error: the one-process reference failed: {reference.error}",
                file=sys.stderr,
            )
            return 2
        parities = []
        for text, ranks, layout in layouts:
            print(f"# {text}: {ranks} ranks ...", file=sys.stderr, flush=True)
            parities.append(
                compare_runs(text, reference, run_trial(spec(ranks, layout), work, args.timeout), args.tol)
            )
    data = {
        "config": args.config,
        "steps": args.steps,
        "global_batch": args.global_batch,
        "seed": args.seed,
        "tolerance": args.tol,
        "reference_losses": list(reference.losses),
        "layouts": [p.to_json() for p in parities],
    }
    if args.json == "-":
        print(json.dumps(data, indent=2))
    else:
        print(table(parities))
    writers = []
    if args.json and args.json != "-":
        writers.append(
            ("JSON", args.json, lambda: Path(args.json).write_text(json.dumps(data, indent=2) + "\n"))
        )
    ok = write_outputs("compare", writers)
    return 0 if ok and all(p.passed for p in parities) else 1
