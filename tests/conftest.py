"""Shared fixtures: multi-rank tests spawn ranks on CPU with gloo through meshwise.runtime.spawn."""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import subprocess
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import meshwise
from meshwise.cli import main
from meshwise.runtime.spawn import PRELOAD
from meshwise.world import World


@pytest.fixture(scope="session", autouse=True)
def rank_server() -> None:
    """Start spawn's forkserver once, before any test, with every meshwise module the collected test
    modules import (and pytest, which they import too) loaded beside torch.

    A spawned rank unpickles its function by module name, so without this every rank of every spawn
    imports the test module's meshwise stack (torch.distributed.tensor, checkpoint, the trainer) itself:
    about 0.7 CPU-s a rank, 1.5 s of wall time for 4 ranks on 2 cores, paid again by each of the suite's
    hundreds of spawns. A forked child shares the server's imports, so it starts with them done. The
    server stays up for the session; ``spawn`` finds it running and reuses it as it is."""
    imported = sorted(name for name in sys.modules if name.split(".")[0] in ("meshwise", "pytest"))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *imported])
    from multiprocessing import forkserver

    forkserver.ensure_running()


@contextlib.contextmanager
def joined(backend: str = "auto", **options: Any) -> Iterator[World]:
    """``meshwise.init(backend, **options)`` for the body of a spawned rank, with ``shutdown()`` however the
    body ends: a failing check then still releases the process group (and gloo's threads), so the rank
    reports its error instead of aborting at exit. Import it in a test module with
    ``from conftest import joined``: the spawned ranks import that module, not pytest's fixtures."""
    world = meshwise.init(backend, **options)
    try:
        yield world
    finally:
        meshwise.shutdown()


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> str:
    """A real text file of ~100 KB for the GPT trainers' tests: the standard library's argparse.py."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path = tmp_path_factory.mktemp("data") / "source.txt"
    path.write_bytes((stdlib / "argparse.py").read_bytes())
    return str(path)


def meshwise_here(command: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """``python -m meshwise ARGS`` (``command``, as a tool would pass it to subprocess) run by this process's
    ``meshwise.cli.main``: its exit status and what it printed, as ``subprocess.run(..., capture_output=True,
    text=True)`` returns them.

    For tests of tools that drive the command line in a child process (benchmark scripts, compare's trials):
    the same command line goes through the same parser and trainer, but its ranks fork from the suite's rank
    server, which has torch and meshwise imported, where a fresh interpreter would import torch, then start
    a rank server importing it again, before it trains (6-8 s of a tiny run's 9 s on 2 busy cores)."""
    assert list(command[:3]) == [sys.executable, "-m", "meshwise"], command
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(command[3:]))
    return subprocess.CompletedProcess(list(command), code, out.getvalue(), err.getvalue())
