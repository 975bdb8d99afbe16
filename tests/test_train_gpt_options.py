"""What users of a training command expect to set (issue 30, Add): the learning-rate schedule's shape,
dropout, AdamW's betas and eps, and checkpoints on their own cadence — each checked before launch."""

from __future__ import annotations

import contextlib
import json
import os

import pytest

import meshwise
from gpt_cli import gpt_argv
from meshwise.cli import main
from meshwise.runtime.spawn import spawn
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.resolve import resolve
from meshwise.train.gpt.sections import OptimizerSection
from meshwise.train.gpt.step_log import checkpoint_due

LR, FLOOR, STEPS, WARMUP = 1.0, 0.1, 20, 2


def _curve(shape: str) -> list[float]:
    schedule = OptimizerSection(lr=LR, min_lr=FLOOR, warmup=WARMUP, steps=STEPS, lr_schedule=shape)
    return [schedule.lr_at(s) for s in range(STEPS)]


def test_every_schedule_warms_up_alike_then_takes_its_shape():
    curves = {shape: _curve(shape) for shape in ("cosine", "linear", "constant", "wsd")}
    for curve in curves.values():
        assert curve[:WARMUP] == [0.5, 1.0]
    assert curves["constant"][WARMUP:] == [LR] * (STEPS - WARMUP)
    for shape in ("cosine", "linear", "wsd"):
        assert curves[shape][-1] == pytest.approx(FLOOR)
    linear = curves["linear"]
    steps = [linear[i] - linear[i + 1] for i in range(WARMUP, STEPS - 1)]
    assert max(steps) == pytest.approx(min(steps))  # a straight line from lr to the floor
    wsd = curves["wsd"]  # stable at the peak until the last 20 % (4 of 20 steps), then linear down
    assert wsd[: STEPS - 4] == [0.5] + [LR] * (STEPS - 5) and wsd[STEPS - 4 :] == pytest.approx(
        [0.775, 0.55, 0.325, 0.1]
    )
    default = OptimizerSection(lr=LR, min_lr=FLOOR, warmup=WARMUP, steps=STEPS)
    assert _curve("cosine") == [default.lr_at(s) for s in range(STEPS)]


def test_checkpoints_follow_checkpoint_every_instead_of_the_evaluations():
    default = GPTTrainConfig.from_flags(checkpoint="c", steps=10)
    assert [s for s in range(1, 11) if checkpoint_due(default, s, evaluated=s % 5 == 0)] == [5, 10]
    every = GPTTrainConfig.from_flags(checkpoint="c", steps=10, checkpoint_every=3)
    assert [s for s in range(1, 11) if checkpoint_due(every, s, evaluated=s % 5 == 0)] == [3, 6, 9, 10]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lr-schedule", "step"], "invalid choice"),
        (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
        (["--beta2", "1.0"], "--beta2 must be in [0, 1)"),
        (["--eps", "0"], "--eps must be a positive number"),
        (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint DIR"),
    ],
)
def test_bad_values_are_one_line_before_launch(text, capsys, flags, message):
    with pytest.raises(SystemExit) if message == "invalid choice" else contextlib.nullcontext():
        assert main(gpt_argv(text, *flags)) == 2
    assert message in capsys.readouterr().err


def _optimizer_settings(text: str) -> tuple[list, list, float]:
    from meshwise.train.gpt.loop import GPTTrainer

    config = GPTTrainConfig.from_flags(config="gpt-tiny", data=text, seq_len=32, global_batch=4, beta1=0.8,
                                       beta2=0.99, eps=1e-6, dropout=0.25, backend="gloo")  # fmt: skip
    world = meshwise.init("gloo", timeout=60, mesh=config.mesh_shape(int(os.environ["WORLD_SIZE"])))
    try:
        trainer = GPTTrainer(world, resolve(config))
        groups = trainer.step_runner.optimizer.param_groups
        return (
            [g["betas"] for g in groups],
            [g["eps"] for g in groups],
            trainer.step_runner.full_model().config.dropout,
        )
    finally:
        meshwise.shutdown()


def test_betas_eps_and_dropout_reach_the_optimizer_and_model(text):
    (betas, eps, dropout) = spawn(_optimizer_settings, 1, args=(text,), timeout=100)[0]
    assert set(betas) == {(0.8, 0.99)} and set(eps) == {1e-6} and dropout == 0.25


def test_a_run_checkpoints_every_n_steps(text, tmp_path):
    directory = tmp_path / "ckpt"
    argv = gpt_argv(text, "--steps", "4", "--eval-every", "100", "--checkpoint", str(directory))
    assert main([*argv, "--checkpoint-every", "3"]) == 0
    assert json.loads((directory / "run.json").read_text())["step"] == 4


def test_keep_leaves_the_latest_k_checkpoints(text, tmp_path):
    directory = tmp_path / "ckpt"
    argv = gpt_argv(text, "--steps", "5", "--eval-every", "100", "--checkpoint", str(directory))
    assert main([*argv, "--checkpoint-every", "1", "--keep", "3"]) == 0
    assert sorted(p.name for p in directory.glob("step-*")) == ["step-000003", "step-000004", "step-000005"]
    assert json.loads((directory / "run.json").read_text())["step"] == 5


def test_stale_steps_spare_the_target_and_the_latest_before_it(tmp_path):
    from meshwise.train.checkpoint import stale_steps, step_dir

    for step in (2, 4, 6, 8):
        step_dir(tmp_path, step).mkdir()
    names = lambda paths: sorted(p.name for p in paths)  # noqa: E731
    assert names(stale_steps(tmp_path, step_dir(tmp_path, 6), 1)) == [
        "step-000002",
        "step-000004",
        "step-000008",
    ]
    assert names(stale_steps(tmp_path, step_dir(tmp_path, 6), 2)) == ["step-000002", "step-000008"]
    assert names(stale_steps(tmp_path, step_dir(tmp_path, 8), 9)) == []
