"""``meshwise train --strategy zero1|zero2|zero3``: runs match DataParallel's, checkpoints resume exactly."""

from __future__ import annotations

import pytest
import torch

import meshwise
from meshwise.cli import main
from meshwise.runtime.spawn import spawn
from meshwise.train import TrainConfig, run_training, save_checkpoint
from meshwise.train.checkpoint import KEYS
from meshwise.train.loop import Trainer


def test_bad_strategies_are_refused_before_any_rank_starts(tmp_path):
    with pytest.raises(ValueError, match="--strategy 'zero4' is unknown"):
        TrainConfig("mlp", strategy="zero4").validate()
    written = {key: None for key in KEYS} | {"model": "mlp", "epoch": 1, "strategy": "zero2"}
    save_checkpoint(tmp_path, written)
    with pytest.raises(ValueError, match="written with --strategy zero2; resume it with --strategy zero2"):
        TrainConfig("mlp", epochs=3, checkpoint=str(tmp_path), resume=True).validate()


@pytest.mark.slow
def test_zero3_trains_like_ddp_and_reports_memory_per_rank(capsys):
    settings = {"model": "mlp", "nproc": 2, "epochs": 2, "backend": "gloo", "timeout": 100}
    ddp = run_training(TrainConfig(**settings))
    command = ["train", "mlp", "-np", "2", "--epochs", "2", "--backend", "gloo", "--strategy", "zero3"]
    assert main(command) == 0
    out = capsys.readouterr().out
    assert "Strategy            = zero3" in out and "rank 1: parameters" in out, out
    zero = run_training(TrainConfig(**settings, strategy="zero1"))
    assert zero.memory and zero.parameters == ddp.parameters
    for a, b in zip(ddp.history, zero.history, strict=True):
        assert a.train_loss == pytest.approx(b.train_loss, abs=1e-6)
        assert a.val_accuracy == b.val_accuracy


def _resume(root: str) -> dict[str, object]:
    world = meshwise.init("gloo", timeout=60)

    def config(name: str, resume: bool = False) -> TrainConfig:
        return TrainConfig("mlp", epochs=2, checkpoint=f"{root}/{name}", resume=resume, backend="gloo",
                           strategy="zero2")  # fmt: skip

    straight = Trainer(world, config("straight"))
    straight.run()
    interrupted = Trainer(world, config("resumed"))
    interrupted.run_epoch(0)  # the job dies here, after its epoch-1 checkpoint
    del interrupted
    world.comm.barrier()
    resumed = Trainer(world, config("resumed", resume=True))
    result = resumed.run()
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    out = {
        "same parameters": all(torch.equal(a[k], b[k]) for k in a),
        "same final loss": straight.history[-1].train_loss == resumed.history[-1].train_loss,
        "first epoch": result.first_epoch,
    }
    meshwise.shutdown()
    return out


@pytest.mark.slow
def test_a_zero_run_resumed_after_epoch_one_ends_where_two_straight_epochs_end(tmp_path):
    for result in spawn(_resume, 2, args=(str(tmp_path),), timeout=100):
        assert result == {"same parameters": True, "same final loss": True, "first epoch": 1}
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == ["checkpoint.pt", "zero-epoch2"]
