"""Nothing finished is lost and nothing is wasted: rows stream out and survive a timeout, a failed rank
or Ctrl-C; output paths are checked before the run; Ctrl-C is one line (issue 20, items 2, 6, 7)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshwise.bench import runner
from meshwise.cli import main
from meshwise.comm.api import PeerFailureError

ROW = re.compile(r"^\s+\d+\s+\d+\s+float32\s")
#: thousands of tiny sizes: rows finish every few milliseconds and the sweep never ends on its own
ENDLESS = [
    "bench",
    "all_reduce",
    "-b",
    "4",
    "-e",
    "400K",
    "-i",
    "4",
    "-n",
    "1",
    "-w",
    "0",
    "-c",
    "0",
    "--backend",
    "gloo",
]


def _rows(text: str) -> int:
    return sum(1 for line in text.splitlines() if ROW.match(line))


def _json_rows(path: Path) -> tuple[str | None, int]:
    data = json.loads(path.read_text())
    return data.get("incomplete"), sum(len(run["rows"]) for run in data["runs"])


def _environment() -> dict[str, str]:
    source = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([source, os.environ.get("PYTHONPATH", "")])}


def test_a_timeout_keeps_every_finished_row_printed_and_in_the_json(tmp_path, capsys):
    path = tmp_path / "partial.json"
    code = main([*ENDLESS, "-np", "2", "--timeout", "8", "--json", str(path)])
    out, err = capsys.readouterr()
    assert code == 1 and "did not finish within 8 s" in err
    reason, rows = _json_rows(path)
    assert reason is not None and "did not finish within 8 s" in reason
    assert rows > 0 and _rows(out) == rows  # each row was printed as it finished, none lost
    assert f"# JSON of the {rows} finished rows written to {path}" in out


def test_a_rank_that_fails_mid_sweep_keeps_the_rows_before_it(tmp_path, capsys, monkeypatch):
    calls = []
    real = runner._timed_loop  # the default timing (-n operations back to back, nccl-tests)

    def dies_at_the_third_size(*args):
        calls.append(1)
        if len(calls) == 5:  # each size is timed twice, out of place and in place
            raise PeerFailureError("rank 1 died while this rank waited for it", rank=0, op="all_reduce")
        return real(*args)

    monkeypatch.setattr(runner, "_timed_loop", dies_at_the_third_size)
    path, png = tmp_path / "partial.json", tmp_path / "partial.png"
    code = main([*ENDLESS, "-np", "1", "--json", str(path), "--plot", str(png)])
    out, err = capsys.readouterr()
    assert code == 1 and "rank 1 died" in err
    assert _json_rows(path) == ("[rank 0 · all_reduce] rank 1 died while this rank waited for it", 2)
    assert _rows(out) == 2 and png.stat().st_size > 0


def test_ctrl_c_is_one_line_and_keeps_the_rows(tmp_path):
    path = tmp_path / "interrupted.json"
    command = [sys.executable, "-m", "meshwise", *ENDLESS, "-np", "2", "--json", str(path)]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_environment(),
        start_new_session=True,
        preexec_fn=_terminal_sigint,
    )
    try:
        assert proc.stdout is not None
        printed = 0
        deadline = time.monotonic() + 60
        while printed < 3 and time.monotonic() < deadline:  # rows reach a pipe as they finish
            printed += bool(ROW.match(proc.stdout.readline()))
        assert printed == 3
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130
    assert err == "meshwise bench: SIGINT received, stopped\n"
    reason, rows = _json_rows(path)
    assert reason == "interrupted (SIGINT)" and rows >= 3


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["bench", "all_reduce", "--json", "/nonexistent/dir/x.json"],
            "directory /nonexistent/dir does not exist",
        ),
        (["bench", "all_reduce", "--plot", "x.jpgx"], "unknown image format .jpgx; end the name with one of"),
        (["bench", "all_reduce", "--plot", "plot"], "unknown image format (no extension)"),
        (["train", "mlp", "--json", "/nonexistent/dir/x.json"], "directory /nonexistent/dir does not exist"),
        (["scale", "pi-midpoint", "--json", "/nonexistent/x.json"], "directory /nonexistent does not exist"),
        (["scale", "pi-midpoint", "--plot", "x.jpgx"], "unknown image format .jpgx"),
        (["info", "--json", "/nonexistent/dir/x.json"], "directory /nonexistent/dir does not exist"),
    ],
)
def test_output_paths_are_checked_before_the_run(argv, message, capsys, tmp_path):
    started = time.monotonic()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"meshwise {argv[0]}: error: ") and message in err
    assert time.monotonic() - started < 10  # refused up front, not after a run


def test_a_directory_as_output_file_is_refused(tmp_path, capsys):
    assert main(["bench", "all_reduce", "--json", str(tmp_path)]) == 2
    assert "is a directory; give a file name" in capsys.readouterr().err


def test_a_failed_json_write_does_not_skip_the_plot(tmp_path, capsys, monkeypatch):
    from meshwise.cli import bench

    def full_disk(path, record):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench, "write_json", full_disk)
    path, png = tmp_path / "x.json", tmp_path / "x.png"
    argv = [
        "bench",
        "all_reduce",
        "-np",
        "1",
        "-b",
        "1K",
        "-e",
        "2K",
        "-n",
        "1",
        "-w",
        "0",
        "--backend",
        "gloo",
    ]
    assert main([*argv, "--json", str(path), "--plot", str(png)]) == 1
    out, err = capsys.readouterr()
    assert f"meshwise bench: error: could not write {path}: No space left on device" in err
    assert f"# plot written to {png}" in out and png.stat().st_size > 0


@pytest.fixture
def interruptible():
    """Ctrl-C raises KeyboardInterrupt, as in a terminal, whatever this process inherited (a
    non-interactive shell starts a background job, e.g. `pytest &`, with SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _terminal_sigint() -> None:
    """In the child before exec: SIGINT delivered, as in a terminal (see :func:`interruptible`)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_of_train_is_one_line(capsys, monkeypatch, interruptible):
    from meshwise.runtime import spawn

    real = spawn._collect

    def interrupted(*args):  # Ctrl-C while the ranks train (the ranks themselves are stopped by spawn)
        os.kill(os.getpid(), signal.SIGINT)
        return real(*args)

    monkeypatch.setattr(spawn, "_collect", interrupted)
    try:
        code = main(["train", "mlp", "-np", "2", "--backend", "gloo"])
    except KeyboardInterrupt:  # must not end the test session
        pytest.fail("Ctrl-C escaped `meshwise train` as a KeyboardInterrupt traceback")
    assert code == 130
    assert capsys.readouterr().err == "meshwise train: SIGINT received, stopped\n"
