"""``meshwise doctor``: check this machine for what breaks distributed jobs; print pass/warn/fail + fix.

meshwise doctor                 # checks for as many ranks as this node would run (GPUs, else cores)
meshwise doctor -np 8 --json    # for 8 local ranks, machine-readable
meshwise doctor --master-addr 10.0.0.1   # on each node: the checks `meshwise run --nnodes K` makes
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.console import Console
from rich.table import Table

from meshwise.cli import summary

_STYLE = {"pass": "green", "warn": "yellow", "fail": "bold red"}


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(
        name,
        help=help_text,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=summary(__doc__),
        epilog="examples:\n" + __doc__.split("\n\n")[1],
    )
    parser.add_argument(
        "-np", "--nproc", dest="nprocs", type=int, metavar="N", help="local ranks the job will run"
    )
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument(
        "--master-addr",
        metavar="A",
        help="node 0's address: check this node's route and interface to it, and that it answers",
    )
    parser.add_argument(
        "--master-port", type=int, default=29500, metavar="P", help="rendezvous port (default 29500)"
    )
    parser.set_defaults(func=handle)


def _default_ranks() -> int:
    import torch

    from meshwise.runtime.cores import available_cores

    return torch.cuda.device_count() if torch.cuda.is_available() else max(2, min(available_cores(), 8))


def handle(args: argparse.Namespace) -> int:
    from meshwise.doctor import run_checks

    if args.nprocs is not None and args.nprocs < 1:
        print(f"meshwise doctor: error: -np must be at least 1, got {args.nprocs}", file=sys.stderr)
        return 2
    ranks = args.nprocs or _default_ranks()
    checks = run_checks(ranks, master=(args.master_addr, args.master_port) if args.master_addr else None)
    failed = any(c.status == "fail" for c in checks)
    if args.json:
        json.dump(
            {"ranks": ranks, "ok": not failed, "checks": [c.to_json() for c in checks]}, sys.stdout, indent=1
        )
        sys.stdout.write("\n")
    else:
        table = Table(title=f"meshwise doctor ({ranks} local ranks)", show_lines=False)
        for column in ("check", "status", "finding", "fix"):
            table.add_column(column, overflow="fold")
        for c in checks:
            table.add_row(c.name, f"[{_STYLE[c.status]}]{c.status}[/]", c.detail, c.fix)
        Console(soft_wrap=False).print(table)
        counts = {s: sum(c.status == s for c in checks) for s in _STYLE}
        print(", ".join(f"{n} {s}" for s, n in counts.items()))
    return 1 if failed else 0
