"""``meshwise train`` stopping safely: divergence, unusable or unwritable checkpoints, changed settings.

Each failure must be one line on stderr with the right exit code, found before training where it can be,
and must leave a good checkpoint on disk untouched.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from meshwise.cli import main
from meshwise.train import TrainingError
from meshwise.train.checkpoint import read_train_run, step_dir
from meshwise.train.notes import resume_notes
from test_data import write_mnist


def _train(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["train", "mlp", "--backend", "gloo", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("meshwise train: error: "), err
    return err


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A real one-epoch mlp checkpoint directory, trained once for the whole module (copy it to change it)."""
    directory = tmp_path_factory.mktemp("good")
    assert main(["train", "mlp", "--backend", "gloo", "--epochs", "1", "--checkpoint", str(directory)]) == 0
    return directory


def _with_checkpoint(tmp_path, good: Path) -> str:
    shutil.copytree(good, tmp_path, dirs_exist_ok=True)
    return str(tmp_path)


def _files(directory) -> dict[str, bytes]:
    root = Path(directory)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_divergence_stops_with_one_line_and_keeps_the_good_checkpoint(tmp_path, capsys, good):
    directory = _with_checkpoint(tmp_path, good)
    code, _, err = _train(capsys, "--epochs", "3", "--lr", "1e6", "--checkpoint", directory, "--resume")
    assert code == 1
    assert "training diverged: the loss became nan in epoch 2" in _one_line(err)
    assert "the epoch-1 checkpoint is kept" in err and "lower --lr" in err
    assert _files(tmp_path) == _files(good)


def test_divergence_on_two_ranks_is_one_line_too(capsys):
    code = main(["train", "mlp", "-np", "2", "--backend", "gloo", "--epochs", "1", "--lr", "1e6"])
    assert code == 1
    assert "training diverged" in _one_line(capsys.readouterr().err)


def test_changed_hyper_parameters_on_resume_are_noted(tmp_path, capsys, good):
    directory = _with_checkpoint(tmp_path, good)
    code, out, _ = _train(
        capsys, "--epochs", "2", "--lr", "0.02", "--seed", "3", "--checkpoint", directory, "--resume"
    )
    assert code == 0
    assert "note: the checkpoint's run used lr 0.01; the remaining epochs use 0.02" in out
    assert "note: --seed 3 differs from the checkpoint's 0" in out
    assert "note: --epochs 2 differs from the checkpoint's 1" in out
    assert read_train_run(directory)["epoch"] == 2


def test_resume_notes_are_plain_data():
    run = {"world_size": 2, "batch_size": 32, "base_lr": 0.01, "lr": 0.02, "seed": 0, "epochs": 4}
    assert resume_notes(run, dict(run)) == []
    notes = resume_notes(run, {**run, "world_size": 4, "lr": 0.04})
    assert len(notes) == 2 and "4 × 32 changes the global batch" in notes[0] and "use 0.04" in notes[1]
    assert "ranks × --batch-size = 64 to continue it exactly" in notes[0]
    # other ranks with the same global batch take the same samples per step: nothing to note
    assert resume_notes(run, {**run, "world_size": 4, "batch_size": 16}) == []


def test_a_checkpoint_of_other_data_is_named(tmp_path, capsys):
    write_mnist(tmp_path / "mnist", images=12)
    checkpoint = str(tmp_path / "ckpt")
    args = ["train", "cnn", "--backend", "gloo", "--checkpoint", checkpoint]
    assert main([*args, "--epochs", "1", "--data", str(tmp_path / "mnist")]) == 0
    capsys.readouterr()
    code = main([*args, "--epochs", "2", "--resume"])
    err = capsys.readouterr().err
    assert code == 2
    assert "was trained on mnist, but this run loads digits" in _one_line(err)


def _damage_run_json(directory: Path, good: Path, data: bytes) -> None:
    (directory / "run.json").write_bytes(data)


def _damage_tensors(directory: Path, good: Path, how: str) -> None:
    run = read_train_run(good)
    steps = step_dir(directory, run["step"])
    if how == "metadata":
        (steps / ".metadata").write_bytes(os.urandom(256))
    else:
        shard = next(steps.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:100])


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda d, g: _damage_run_json(d, g, b""), "run.json is not readable JSON"),
        (
            lambda d, g: _damage_run_json(d, g, (g / "run.json").read_bytes()[:50]),
            "run.json is not readable JSON",
        ),
        (lambda d, g: _damage_run_json(d, g, os.urandom(4096)), "run.json is not readable JSON"),
        (lambda d, g: _damage_tensors(d, g, "metadata"), ".metadata is unreadable"),
        (lambda d, g: _damage_tensors(d, g, "shard"), "is truncated"),
    ],
    ids=["empty", "truncated", "garbage", "metadata", "tensors"],
)
def test_damaged_checkpoints_are_one_line_with_exit_code_2(tmp_path, capsys, good, damage, message):
    directory = _with_checkpoint(tmp_path, good)
    damage(tmp_path, good)
    code, _, err = _train(capsys, "--epochs", "3", "--checkpoint", directory, "--resume")
    assert code == 2 and message in _one_line(err)


def test_an_incomplete_checkpoint_names_what_it_lacks(tmp_path, capsys):
    step_dir(tmp_path, 1).mkdir()
    (tmp_path / "run.json").write_text(json.dumps({"format": "meshwise-train/2", "step": 1, "model": "mlp"}))
    code, _, err = _train(capsys, "--epochs", "3", "--checkpoint", str(tmp_path), "--resume")
    assert code == 2 and "not a complete meshwise checkpoint (no epoch, sampler" in _one_line(err)


def test_an_unwritable_checkpoint_directory_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for directory in ("/proc/meshwise-checkpoints", str(tmp_path / "file" / "sub")):
        code, out, err = _train(capsys, "--checkpoint", directory)
        assert code == 2 and f"--checkpoint {directory} is not writable" in _one_line(err)
        assert "epoch" not in out  # refused before any epoch ran


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path, capsys, good):
    directory = _with_checkpoint(tmp_path, good)
    # the in-process rank (-np 1) writes run.json's temporary file here: make it /dev/full, a device whose
    # every write fails with ENOSPC, exactly as a full filesystem does
    (tmp_path / f".run.json.{os.getpid()}.tmp").symlink_to("/dev/full")
    code, _, err = _train(capsys, "--epochs", "2", "--checkpoint", directory, "--resume")
    assert code == 1
    assert "no space left on device" in _one_line(err) and "the epoch-1 checkpoint is kept" in err
    assert (tmp_path / "run.json").read_bytes() == (good / "run.json").read_bytes()
    assert read_train_run(directory)["epoch"] == 1  # what it names is intact


def test_a_tensor_write_that_fails_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, capsys, good):
    """DCP's own failure (a file where the next step's directory goes): every rank stops with one line."""
    directory = _with_checkpoint(tmp_path, good)
    step = read_train_run(good)["step"]
    step_dir(tmp_path, 2 * step).write_text("in the way")  # the next epoch's step, on as many ranks
    code, _, err = _train(capsys, "--epochs", "2", "--checkpoint", directory, "--resume")
    assert code == 1
    assert f"cannot write the checkpoint in {directory} (File exists)" in _one_line(err)
    assert "the epoch-1 checkpoint is kept" in err and read_train_run(directory)["epoch"] == 1


def test_training_errors_keep_their_exit_code_across_processes():
    error = pickle.loads(pickle.dumps(TrainingError("x", exit_code=2)))
    assert (str(error), error.exit_code) == ("x", 2)
