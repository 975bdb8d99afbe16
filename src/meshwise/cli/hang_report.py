"""``meshwise hang-report``: merge the flight-recorder dumps of several nodes into one hang report.

meshwise hang-report node0-flight node1-flight         # summary and full report on stdout
meshwise hang-report /shared/flight -o report.txt      # a shared --flight-dir; the full report to a file

``meshwise run`` merges its ranks' dumps itself, across nodes too (through node 0's coordinator). When
that could not happen — node 0 died, or another launcher started the ranks — each node's ``--flight-dir``
(copied to one machine, or one directory on a shared file system: dump files are named by global rank)
is merged here, to say which rank on which node never entered the collective the others wait in.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from meshwise.cli import summary


def add_parser(subparsers: argparse._SubParsersAction, name: str, help_text: str) -> None:
    parser = subparsers.add_parser(
        name,
        help=help_text,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=summary(__doc__),
        epilog="examples:\n" + __doc__.split("\n\n")[1],
    )
    parser.add_argument("directories", nargs="+", metavar="DIR", help="flight dump directories (rank*.json)")
    parser.add_argument("-o", "--output", default=None, metavar="FILE", help="write the full report to FILE")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from meshwise.cli.outputs import check_output
    from meshwise.runtime.flight_dumps import load_directories
    from meshwise.runtime.hang_report import render, summarize

    try:
        check_output("--output", args.output)
        dumps, ranks = load_directories([Path(d) for d in args.directories])
    except (ValueError, FileNotFoundError) as exc:
        print(f"meshwise hang-report: error: {exc}", file=sys.stderr)
        return 2
    reasons = sorted({str(dump.get("reason", "?")) for dump in dumps.values()})
    report = render(dumps, ranks, "; ".join(reasons))
    if args.output is None:
        print(report, end="")
        return 0
    Path(args.output).write_text(report)
    print(f"meshwise hang-report: {len(dumps)} of {len(ranks)} ranks dumped")
    print("\n".join(f"  {line}" for line in summarize(dumps, ranks)))
    print(f"  full report: {args.output}")
    return 0
