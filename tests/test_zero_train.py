"""``meshwise train --strategy zero1|zero2|zero3``: the trainer's runs match DataParallel's."""

from __future__ import annotations

import pytest

from meshwise.cli import main
from meshwise.train import TrainConfig, run_training


def test_bad_strategies_are_refused_before_any_rank_starts(tmp_path):
    with pytest.raises(ValueError, match="--strategy 'zero4' is unknown"):
        TrainConfig("mlp", strategy="zero4").validate()
    with pytest.raises(ValueError, match="--checkpoint is not available with --strategy zero2"):
        TrainConfig("mlp", strategy="zero2", checkpoint=str(tmp_path)).validate()


@pytest.mark.slow
def test_zero3_trains_like_ddp_and_reports_memory_per_rank(capsys):
    settings = {"model": "mlp", "nproc": 2, "epochs": 2, "backend": "gloo", "timeout": 100}
    ddp = run_training(TrainConfig(**settings))
    assert (
        main(["train", "mlp", "-np", "2", "--epochs", "2", "--backend", "gloo", "--strategy", "zero3"]) == 0
    )
    out = capsys.readouterr().out
    assert "Strategy            = zero3" in out and "rank 1: parameters" in out, out
    zero = run_training(TrainConfig(**settings, strategy="zero1"))
    assert zero.memory and zero.parameters == ddp.parameters
    for a, b in zip(ddp.history, zero.history, strict=True):
        assert a.train_loss == pytest.approx(b.train_loss, abs=1e-6)
        assert a.val_accuracy == b.val_accuracy
