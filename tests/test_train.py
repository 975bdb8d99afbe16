"""``meshwise train``: input validation, exact resume, and the default CNN run reaching ≥ 97%."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import meshwise
from meshwise.cli import main
from meshwise.models import SmallCNN
from meshwise.runtime.spawn import spawn
from meshwise.scale.runner import WALL_TIME_LINE
from meshwise.train import WORKLOADS, TrainConfig, checkpoint
from meshwise.train.loop import Trainer
from meshwise.train.resolve import resolve
from test_data import write_mnist


# ---------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"model": "resnet"}, "unknown model"),
        ({"nproc": 0}, "-np must be at least 1"),
        ({"epochs": 0}, "--epochs must be at least 1"),
        ({"batch_size": 0}, "--batch-size must be a positive"),
        ({"batch_size": -4}, "--batch-size must be a positive"),
        ({"lr": 0.0}, "--lr must be a positive"),
        ({"lr": math.nan}, "--lr must be a positive"),
        ({"seed": -1}, "--seed"),
        ({"timeout": 0}, "--timeout"),
        ({"backend": "tcp"}, "--backend 'tcp' is unknown"),
        ({"resume": True}, "--resume needs --checkpoint"),
        ({"model": "mlp", "data_dir": "."}, "--data is only for cnn"),
    ],
)
def test_bad_settings_are_refused_before_any_rank_starts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        resolve(TrainConfig.from_flags(**{"model": "cnn", **kwargs}))


def test_missing_paths_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve(TrainConfig.from_flags("cnn", checkpoint=str(tmp_path / "nope"), resume=True))
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        resolve(TrainConfig.from_flags("cnn", checkpoint=str(tmp_path), resume=True))
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        resolve(TrainConfig.from_flags("cnn", data_dir=str(tmp_path)))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        resolve(TrainConfig.from_flags("cnn", checkpoint=str(tmp_path / "file")))


def _run_json(directory: Path, **fields: object) -> None:
    """A run.json of ``train mlp|cnn`` (and the step directory it names), to test the checks made on it."""
    run = {"format": checkpoint.TRAIN_FORMAT, "step": 5, "model": "mlp", "epoch": 3, "sampler": {}, "rng": "",
           "run": {}, "history": []} | fields  # fmt: skip
    checkpoint.step_dir(directory, run["step"]).mkdir(parents=True, exist_ok=True)
    (directory / "run.json").write_text(json.dumps(run))


def test_checkpoints_are_checked_against_the_run_that_resumes_them(tmp_path):
    _run_json(tmp_path)
    with pytest.raises(ValueError, match="already exists; pass --resume"):
        resolve(TrainConfig.from_flags("mlp", checkpoint=str(tmp_path)))
    with pytest.raises(ValueError, match="holds a 'mlp' run, not 'cnn'"):
        resolve(TrainConfig.from_flags("cnn", checkpoint=str(tmp_path), resume=True))
    with pytest.raises(ValueError, match="already completed 3 of --epochs 3"):
        resolve(TrainConfig.from_flags("mlp", epochs=3, checkpoint=str(tmp_path), resume=True))
    # past those checks, the tensors it names are checked to be intact (here: there are none)
    with pytest.raises(ValueError, match=r"step-000005/\.metadata is missing"):
        resolve(TrainConfig.from_flags("mlp", epochs=4, checkpoint=str(tmp_path), resume=True))
    (tmp_path / "run.json").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="is not readable JSON"):
        checkpoint.read_train_run(tmp_path)


def test_cnn_workload_sizes_itself_for_mnist_files(tmp_path):
    write_mnist(tmp_path, images=6)
    resolve(TrainConfig.from_flags("cnn", data_dir=str(tmp_path)))
    workload = WORKLOADS["cnn"]
    splits = workload.load_data(str(tmp_path))
    model = workload.build_model(splits)
    assert splits.name == "mnist" and abs(splits.train.inputs.mean().item()) < 1e-5  # standardized
    assert model(splits.val.inputs).shape == (6, 10)


def test_the_command_line_reports_bad_input_with_exit_code_2(capsys):
    assert main(["train", "cnn", "-np", "2", "--batch-size", "0"]) == 2
    assert "meshwise train: error: --batch-size must be a positive number" in capsys.readouterr().err


def test_a_save_repoints_run_json_and_leaves_only_the_latest_step(tmp_path):
    """One process, no process group: DCP writes alone; no temporary file is left, older steps go."""
    for step in (4, 8):
        weights = {"model": {"w": torch.full((3,), float(step))}}
        path = checkpoint.save(tmp_path, step, weights, {"epoch": step // 4}, format="f/1", is_main=True,
                               barrier=lambda: None)  # fmt: skip
    assert path == tmp_path / "step-000008"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "step-000008"]
    state = {"model": {"w": torch.zeros(3)}}
    assert checkpoint.read_run(tmp_path, "f/1") == {"format": "f/1", "step": 8, "epoch": 2}
    dcp.load(state, checkpoint_id=str(path))
    assert torch.equal(state["model"]["w"], torch.full((3,), 8.0))


# ---------------------------------------------------------------------------------------------- resume
def _resume(root: str) -> dict[str, object]:
    world = meshwise.init("gloo", timeout=60)

    def config(name: str, resume: bool = False) -> TrainConfig:
        return TrainConfig.from_flags(
            "mlp", epochs=2, checkpoint=f"{root}/{name}", resume=resume, backend="gloo"
        )

    straight = Trainer(world, config("straight"))
    straight.run()
    interrupted = Trainer(world, config("resumed"))
    interrupted.run_epoch(0)  # the job dies here, after its epoch-1 checkpoint
    del interrupted
    world.comm.barrier()  # a restarted job finds the file rank 0 wrote
    resumed = Trainer(world, config("resumed", resume=True))
    result = resumed.run()
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    out = {
        "same parameters": list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a),
        "same final loss": straight.history[-1].train_loss == resumed.history[-1].train_loss,
        "first epoch": result.first_epoch,
        "epochs in history": len(result.history),
    }
    meshwise.shutdown()
    return out


def test_resuming_after_epoch_one_ends_exactly_where_two_straight_epochs_end(tmp_path):
    results = spawn(_resume, 2, args=(str(tmp_path),), timeout=100)
    for result in results:
        assert result == {
            "same parameters": True,
            "same final loss": True,
            "first epoch": 1,
            "epochs in history": 2,
        }


def test_a_batch_above_the_shard_is_noted(capsys):
    """mlp's 1024 samples less the validation split, on one rank: a batch of 5000 cannot be filled."""
    assert main(["train", "mlp", "-np", "1", "--epochs", "1", "--batch-size", "5000"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "note: --batch-size 5000 is above the" in out
    assert "training samples of each rank's shard: every step uses the whole shard (1 step per epoch)" in out


# ---------------------------------------------------------------------------------------------- default run
def test_default_cnn_run_on_two_ranks_reaches_97_percent(tmp_path, capsys):
    report = tmp_path / "run.json"
    assert (
        main(["train", "cnn", "-np", "2", "--checkpoint", str(tmp_path / "ckpt"), "--json", str(report)]) == 0
    )
    out = capsys.readouterr().out
    assert "===== TRAINING SUMMARY =====" in out
    data = json.loads(report.read_text())
    # `meshwise scale train:cnn` reads the run's own wall time from the summary
    wall = WALL_TIME_LINE.search(out)
    assert wall is not None and float(wall.group(1)) == pytest.approx(data["wall_seconds"], abs=1e-3)
    assert data["world_size"] == 2 and data["lr"] == 2 * data["base_lr"]  # linear scaling
    assert len(data["history"]) == data["epochs"] == 20
    assert data["val_accuracy"] >= 0.97
    # the checkpoint, read with torch alone, loads into the plain model: no "module." prefix
    run = checkpoint.read_train_run(tmp_path / "ckpt")
    assert run["epoch"] == 20 and run["run"]["world_size"] == 2
    dcp_to_torch_save(checkpoint.step_dir(tmp_path / "ckpt", run["step"]), tmp_path / "plain.pt")
    SmallCNN().load_state_dict(torch.load(tmp_path / "plain.pt", weights_only=False)["model"])
