"""The ``meshwise`` command line.

Each subcommand lives in its own module under ``meshwise.cli`` and exposes ``add_parser(subparsers)``,
which registers its arguments and sets ``func`` to its ``handler`` (returning an exit code). Modules are
imported lazily, so ``meshwise info`` does not pay for matplotlib or the training stack.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Sequence

#: subcommand -> (module, one-line help); order is the order of ``meshwise --help``.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run", "start N workers with torchrun's environment; fail fast, restart, or print an sbatch"),
    "info": ("info", "what this process sees: launcher, rank layout, backends, devices, topology, /dev/shm"),
    "bench": ("bench", "collective benchmarks as nccl-tests: time, algbw, busbw, checks, JSON, plots"),
    "pi": ("pi", "compute π by the midpoint rule or Monte Carlo on N ranks (the lecture's exercises)"),
    "scale": ("scale", "strong/weak scaling study of a workload or command: speedup, efficiency, causes"),
    "train": ("train", "data-parallel training of the reference models: progress, validation, checkpoints"),
    "plan": ("plan", "predict per-GPU memory and step time of every layout; pick one and explain it"),
    "compare": ("compare", "train layouts K steps from one seed: |Δloss| and first divergence vs one rank"),
    "doctor": ("doctor", "check this machine for what breaks distributed jobs: pass/warn/fail with the fix"),
    "hang-report": ("hang_report", "merge several nodes' flight dumps into one report: who hangs where"),
}


_RST_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def summary(doc: str | None) -> str:
    """The first line of a module docstring as help text: without reStructuredText markup
    (````x```` and ``:func:`x```` read as plain ``x`` in a terminal)."""
    first = (doc or "").strip().splitlines()[0]
    return _RST_ROLE.sub(r"\1", first).replace("``", "")


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The parser with ``selected``'s flags; every other command is listed by name and help text only,
    its module not imported (``meshwise --help`` and ``meshwise plan`` start without torch)."""
    parser = argparse.ArgumentParser(prog="meshwise", description=summary(__doc__))
    from meshwise import __version__

    parser.add_argument("--version", action="version", version=f"meshwise {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        if selected == name:
            importlib.import_module(f"meshwise.cli.{module}").add_parser(subparsers, name, help_text)
        else:
            subparsers.add_parser(name, help=help_text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if not a.startswith("-")), None)
    try:
        return _run(argv, selected)
    except KeyboardInterrupt:
        # Ctrl-C, also while torch is still importing: the ranks are already stopped (spawn's cleanup
        # ran on the way up); one line, as `meshwise run` says it, and the shell's status for SIGINT.
        name = f"meshwise {selected}" if selected in COMMANDS else "meshwise"
        print(f"{name}: SIGINT received, stopped", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `meshwise info --json | head`: the reader left; say nothing more and exit as a killed writer does.
        sys.stderr.close()
        return 141


def _run(argv: list[str], selected: str | None) -> int:
    parser = build_parser(selected if selected in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)
