"""A ``train gpt`` run reports as it goes and leaves its results however it ends (issue 30.6): the
``--metrics`` JSON-lines stream, SIGTERM answered as SIGINT naming the checkpoint kept, and ``--json``
written, marked incomplete, when the run was stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpt_cli import gpt_argv
from meshwise.cli import main


def test_every_reported_step_is_a_json_line_and_a_printed_line(text, tmp_path, capsys):
    metrics, summary = tmp_path / "m.jsonl", tmp_path / "s.json"
    argv = gpt_argv(text, "--steps", "4", "--eval-every", "2", "--log-every", "1")
    assert main([*argv, "--metrics", str(metrics), "--json", str(summary)]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["val_loss"] is not None for r in records] == [False, True, False, True]
    assert all(r["loss"] > 0 and r["tokens_per_second"] > 0 and "time" in r for r in records)
    out = capsys.readouterr().out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")] == [
        "1/4",
        "2/4",
        "3/4",
        "4/4",
    ]
    assert json.loads(summary.read_text())["complete"] is True


def test_a_run_past_its_deadline_still_writes_its_json_marked_incomplete(text, tmp_path, capsys):
    metrics, summary = tmp_path / "m.jsonl", tmp_path / "s.json"
    argv = gpt_argv(text, "--steps", "100000", "--log-every", "1", "--timeout", "8")
    assert main([*argv, "--metrics", str(metrics), "--json", str(summary)]) == 124
    result = json.loads(summary.read_text())
    assert result["complete"] is False and "--timeout" in result["stopped"]
    assert result["history"] and result["history"][0]["step"] == 1


def test_a_failed_run_still_writes_its_json_marked_incomplete(text, tmp_path, capsys):
    metrics, summary = tmp_path / "m.jsonl", tmp_path / "s.json"
    argv = gpt_argv(text, "--steps", "6", "--log-every", "1", "--lr", "1e4")  # diverges within a few steps
    assert main([*argv, "--metrics", str(metrics), "--json", str(summary)]) == 1
    assert "training diverged" in capsys.readouterr().err
    result = json.loads(summary.read_text())
    assert result["complete"] is False and "training diverged" in result["stopped"]
    assert result["history"] and result["history"][0]["step"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("sig, ranks", [(signal.SIGTERM, "2"), (signal.SIGINT, "1")])
def test_sigterm_and_sigint_stop_alike_naming_the_checkpoint_kept(text, tmp_path, sig, ranks):
    directory, summary = tmp_path / "ckpt", tmp_path / "s.json"
    argv = gpt_argv(
        text, "-np", ranks, "--steps", "100000", "--eval-every", "2", "--checkpoint", str(directory)
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshwise", *argv, "--json", str(summary)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # delivered, as in a terminal
    )
    try:
        deadline = time.monotonic() + 90
        while not (directory / "run.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (directory / "run.json").exists(), "no checkpoint was written"
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # what Ctrl-C does: the whole foreground group
        else:
            proc.send_signal(sig)  # what kill, Kubernetes or a batch system's first signal does
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + sig, err
    last = err.strip().splitlines()[-1]
    step = json.loads((directory / "run.json").read_text())["step"]
    assert last == (
        f"meshwise train gpt: {sig.name} received, stopped; the checkpoint of step {step} in {directory} is "
        "kept (--resume continues it)"
    )
    assert "Traceback" not in err
    result = json.loads(summary.read_text())
    assert result["complete"] is False and result["checkpoint_step"] == step


def test_reported_steps_become_tensorboard_scalars(text, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = tmp_path / "tb"
    argv = gpt_argv(
        text, "--steps", "3", "--eval-every", "3", "--log-every", "1", "--tensorboard", str(board)
    )
    assert main(argv) == 0
    events = EventAccumulator(str(board))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    assert [e.step for e in events.Scalars("train/val_loss")] == [3]


def test_a_spawned_rank_failure_prints_its_traceback_once_then_the_line_naming_it(capsys):
    from meshwise.cli.training_failure import report_failure
    from meshwise.runtime.spawn import SpawnError

    trace = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\nRuntimeError: boom\n'
    assert report_failure("train gpt", SpawnError(f"rank 1 failed: RuntimeError: boom\n{trace}", rank=1)) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "Traceback (most recent call last):" and err.count("RuntimeError: boom") == 1
    assert err[-1] == "meshwise train gpt: rank 1 failed: RuntimeError: boom"


def test_a_checkpoint_that_cannot_be_written_stops_in_one_line_naming_the_one_kept(text, tmp_path, capsys):
    """A failed write (DCP's own error: a file where step 4's directory goes) stops the run with one line
    naming what is left on disk, as ``train mlp`` does (tests/test_train_failures.py), not a traceback."""
    directory = tmp_path / "run"
    directory.mkdir()
    (directory / "step-000004").write_text("in the way")
    argv = gpt_argv(text, "--steps", "4", "--eval-every", "2", "--checkpoint", str(directory))
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"cannot write the checkpoint in {directory} (File exists); the step-2 checkpoint is kept" in err
    assert json.loads((directory / "run.json").read_text())["step"] == 2  # what it names is intact
