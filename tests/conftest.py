"""Shared fixtures: multi-rank tests spawn ranks on CPU with gloo through meshwise.runtime.spawn."""

from __future__ import annotations

import contextlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import meshwise
from meshwise.world import World


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
