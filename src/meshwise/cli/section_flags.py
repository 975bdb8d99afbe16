"""The flags of the settings sections both ``meshwise train`` commands share (:mod:`meshwise.train.sections`:
mesh and output), written once so the two commands spell and explain them alike; each command passes
its own defaults (its config's ``flag_defaults()``), so no default is written here."""

from __future__ import annotations

import argparse
from typing import Any

from meshwise.train.sections import ZERO_STAGES


def add_mesh_flags(group: argparse._ActionsContainer, defaults: dict[str, Any]) -> None:
    """``-np``, ``--zero``, ``--backend``, ``--device`` (:class:`~meshwise.train.sections.MeshSection`)."""
    group.add_argument(
        "-np",
        "--nproc",
        "--nproc-per-node",
        dest="nproc",
        type=int,
        default=defaults["nproc"],
        help="local ranks to start (default: 1, or the ranks a launcher started)",
    )
    group.add_argument(
        "--zero",
        type=int,
        default=defaults["zero"],
        choices=ZERO_STAGES,
        help="ZeRO stage over the data-parallel ranks: 1 optimizer state, 2 +gradients, 3 +parameters "
        "(default %(default)s: replicas)",
    )
    group.add_argument(
        "--backend",
        default=defaults["backend"],
        help="communicator backend: auto, gloo, nccl, shm, mpi (default %(default)s)",
    )
    group.add_argument(
        "--device", choices=("cpu", "cuda"), default=defaults["device"], help="(default: cuda if present)"
    )


def add_timeout_flag(group: argparse._ActionsContainer, defaults: dict[str, Any]) -> None:
    """``--timeout``: the job's deadline (:class:`~meshwise.train.sections.MeshSection`)."""
    group.add_argument(
        "--timeout",
        type=float,
        default=defaults["timeout"],
        metavar="SECONDS",
        help="a deadline for the whole job in seconds, exit 124 when passed (default: none; a hung "
        "collective is reported after 300 s whatever this says)",
    )


def add_output_flags(
    group: argparse._ActionsContainer, defaults: dict[str, Any], checkpoint_help: str
) -> None:
    """``--checkpoint``, ``--resume``, ``--json`` (:class:`~meshwise.train.sections.OutputSection`)."""
    group.add_argument("--checkpoint", default=defaults["checkpoint"], metavar="DIR", help=checkpoint_help)
    group.add_argument(
        "--resume",
        action="store_true",
        default=defaults["resume"],
        help="continue the run checkpointed in --checkpoint DIR",
    )
    group.add_argument(
        "--json",
        default=defaults["json"],
        metavar="FILE",
        help="write the run's metrics as JSON (default: none)",
    )
