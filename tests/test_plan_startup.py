"""`meshwise plan` on a GPU preset is arithmetic: it answers without importing torch (~2 s of the command's
start), as does `meshwise --help`; the names `meshwise` exports for training still import it when read.

Each probe runs in a fresh interpreter: this test process has long imported torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import meshwise

SRC = str(Path(meshwise.__file__).resolve().parent.parent)


def _probe(code: str) -> dict:
    """Run ``code`` in a fresh interpreter on this checkout; its last stdout line is a JSON object."""
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _after(statements: str) -> dict:
    return _probe(
        "import contextlib, io, json, sys\n"
        f"{statements}\n"
        "print(json.dumps({'torch': 'torch' in sys.modules}))"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--params", "1e9", "--gpus", "8", "--json", "-"],
        ["plan", "--config", "gpt-moe-nano", "--gpus", "16", "--experts", "8", "--top", "3"],
        ["plan", "--layers", "24", "--hidden", "2048", "--heads", "16", "--gpus", "64", "--tp", "4"],
    ],
    ids=["params-json", "moe", "shape-fixed-tp"],
)
def test_plan_on_a_gpu_preset_imports_no_torch(argv: list[str]) -> None:
    result = _after(
        "from meshwise.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    code = main({argv!r})\n"
        "assert code in (0, 1), code"
    )
    assert result == {"torch": False}


def test_the_command_list_imports_no_torch() -> None:
    result = _after(
        "from meshwise.cli import COMMANDS, main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        "assert all(name in out.getvalue() for name in COMMANDS), out.getvalue()"
    )
    assert result == {"torch": False}


def test_importing_the_planner_and_the_package_imports_no_torch() -> None:
    assert _after("import meshwise, meshwise.plan, meshwise.models, meshwise.comm.cost") == {"torch": False}


def test_the_probe_sees_torch_when_an_export_needs_it() -> None:
    """The probes above can fail: reading a lazily exported name that lives with torch imports it."""
    assert _after("import meshwise\nmeshwise.init") == {"torch": True}
    assert _after("from meshwise.models import GPT") == {"torch": True}


def test_lazy_names_read_as_before() -> None:
    from meshwise.comm import Communicator, create_communicator
    from meshwise.comm.api import Communicator as ApiCommunicator
    from meshwise.world import init

    assert meshwise.init is init and Communicator is ApiCommunicator and callable(create_communicator)
    assert {"init", "World", "Communicator"} <= set(dir(meshwise))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        meshwise.nope  # noqa: B018
