"""``meshwise train mlp|cnn|deep-mlp --zero N``: spelled as in ``train gpt``, trains like DataParallel,
and its DCP checkpoints resume exactly on another number of ranks or another stage.

Why the resumes below are exact: every rank takes every W-th sample of one permutation per epoch, so with
ranks × ``--batch-size`` kept (2 × 30 = 3 × 20) and an epoch that needs no padding (240 samples), each
step's global batch holds the same samples on either side of the resume, each rank's share is equal (the
mean of the ranks' means is the global mean), and the learning rate is the same (``--no-lr-scaling``,
cosine over the same steps). What a resume changes is then only the order in which fp32 sums are taken
(2 or 3 ranks' gradients, a reduce-scatter or an all-reduce): the resumed run must equal the uninterrupted
one to within that rounding, parameters and AdamW moments alike, read back with torch's own
``dcp_to_torch_save``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from conftest import joined
from meshwise.cli import main
from meshwise.models import SmallCNN
from meshwise.runtime.spawn import spawn
from meshwise.train import TrainConfig, run_training
from meshwise.train.loop import Trainer
from meshwise.train.resolve import resolve
from test_data import write_mnist

SAMPLES = 240  # train and validation images of the synthetic MNIST files: 4 steps of 60 per epoch
GLOBAL_BATCH = 60
#: fp32 rounding of sums taken in another order, over 4 Adam steps after the resume (measured: 2.5e-8 on
#: 2 → 3 ranks, 0 from one stage to another on the same ranks)
ATOL = 1e-6


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["train", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_zero_is_spelled_as_in_train_gpt(capsys):
    code, _, err = _cli(capsys, "mlp", "--strategy", "zero3")
    assert code == 2 and err == (
        "meshwise train: error: --strategy is gone; ZeRO is --zero N (0|1|2|3), e.g. --zero 3\n"
    )
    with pytest.raises(ValueError, match=r"--zero must be 0, 1, 2 or 3 \(the ZeRO stage\), got 4"):
        resolve(TrainConfig.from_flags("mlp", zero=4))


@pytest.mark.slow
def test_zero3_trains_like_ddp_and_reports_memory_per_rank(capsys):
    settings = {"model": "mlp", "nproc": 2, "epochs": 2, "backend": "gloo", "timeout": 100}
    ddp = run_training(TrainConfig.from_flags(**settings))
    code, out, _ = _cli(capsys, "mlp", "-np", "2", "--epochs", "2", "--backend", "gloo", "--zero", "3")
    assert code == 0
    assert (
        "Strategy            = ZeRO-3 (sharded data parallel, --zero 3)" in out
        and "rank 1: parameters" in out
    )
    zero = run_training(TrainConfig.from_flags(**settings, zero=1))
    assert zero.memory and zero.parameters == ddp.parameters
    for a, b in zip(ddp.history, zero.history, strict=True):
        assert a.train_loss == pytest.approx(b.train_loss, abs=1e-6)
        assert a.val_accuracy == b.val_accuracy


# ---------------------------------------------------------------------------------------------- resumes
def _train(data: str, directory: str, zero: int, resume: bool, epochs: list[int]) -> None:
    """On each spawned rank: the cnn on ``data`` for ``epochs`` (0-based) of 2, checkpointing into
    ``directory``; a run that stops after epoch 0 is a job that died there, after its checkpoint."""
    with joined("gloo", timeout=60) as world:
        config = TrainConfig.from_flags(
            "cnn", epochs=2, batch_size=GLOBAL_BATCH // world.world_size, lr_scaling=False, data_dir=data,
            checkpoint=directory, resume=resume, backend="gloo", zero=zero,
        )  # fmt: skip
        trainer = Trainer(world, config)
        assert trainer.first_epoch == (1 if resume else 0)
        for epoch in epochs:
            trainer.run_epoch(epoch)


def _read(directory: Path) -> tuple[dict, dict]:
    """(run.json, the latest checkpoint as one plain state dict) — torch alone, no meshwise."""
    run = json.loads((directory / "run.json").read_text())
    plain = directory / "plain.pt"
    dcp_to_torch_save(directory / f"step-{run['step']:06d}", plain)
    return run, torch.load(plain, weights_only=False)


def _assert_same_training(straight: Path, resumed: Path) -> None:
    run_a, a = _read(straight)
    run_b, b = _read(resumed)
    assert run_a["step"] == run_b["step"] == 8 and run_a["epoch"] == run_b["epoch"] == 2
    assert a["model"].keys() == b["model"].keys() == SmallCNN().state_dict().keys()
    for name, tensor in a["model"].items():
        torch.testing.assert_close(b["model"][name], tensor, atol=ATOL, rtol=0, msg=name)
    assert a["optim"]["state"].keys() == b["optim"]["state"].keys()
    for name, moments in a["optim"]["state"].items():
        for key, value in moments.items():
            torch.testing.assert_close(
                b["optim"]["state"][name][key], value, atol=ATOL, rtol=0, msg=name + key
            )
    for h_a, h_b in zip(run_a["history"], run_b["history"], strict=True):
        assert h_b["train_loss"] == pytest.approx(h_a["train_loss"], abs=ATOL)
        assert h_b["val_accuracy"] == h_a["val_accuracy"]


@pytest.fixture(scope="module")
def mnist(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("mnist")
    write_mnist(directory, images=SAMPLES)
    return str(directory)


def test_cnn_zero3_on_two_ranks_resumes_on_three_as_if_never_stopped(tmp_path, mnist):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    spawn(_train, 2, args=(mnist, straight, 3, False, [0, 1]), timeout=120)
    spawn(_train, 2, args=(mnist, resumed, 3, False, [0]), timeout=120)
    spawn(_train, 3, args=(mnist, resumed, 3, True, [1]), timeout=120)
    _assert_same_training(tmp_path / "straight", tmp_path / "resumed")


@pytest.mark.parametrize("before,after", [(1, 0), (0, 1)], ids=["zero1-to-zero0", "zero0-to-zero1"])
def test_a_resume_changes_the_zero_stage_exactly(tmp_path, mnist, before, after):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    spawn(_train, 2, args=(mnist, straight, before, False, [0, 1]), timeout=120)
    spawn(_train, 2, args=(mnist, resumed, before, False, [0]), timeout=120)
    spawn(_train, 2, args=(mnist, resumed, after, True, [1]), timeout=120)
    _assert_same_training(tmp_path / "straight", tmp_path / "resumed")


# ---------------------------------------------------------------------------------------------- reading
def test_a_cnn_checkpoint_read_with_torch_alone_loads_into_the_plain_model(tmp_path, capsys):
    """ZeRO-3's shards, read back by ``dcp_to_torch_save``, are the plain SmallCNN that was validated:
    its accuracy on the validation split is the one the run reported."""
    directory = tmp_path / "ckpt"
    args = [
        "cnn",
        "-np",
        "2",
        "--epochs",
        "1",
        "--backend",
        "gloo",
        "--zero",
        "3",
        "--checkpoint",
        str(directory),
    ]
    assert _cli(capsys, *args, "--json", str(tmp_path / "out.json"))[0] == 0
    reported = json.loads((tmp_path / "out.json").read_text())["val_accuracy"]
    _, state = _read(directory)
    model = SmallCNN()
    model.load_state_dict(state["model"])  # strict: every name, every shape
    from meshwise.train.workloads import WORKLOADS

    val = WORKLOADS["cnn"].load_data(None).val
    with torch.no_grad():
        accuracy = (model(val.inputs).argmax(1) == val.targets).double().mean().item()
    assert accuracy == pytest.approx(reported, abs=1e-9)


def test_a_checkpoint_of_another_model_or_trainer_is_one_line(tmp_path, capsys):
    directory = tmp_path / "mlp"
    assert _cli(capsys, "mlp", "--epochs", "1", "--backend", "gloo", "--checkpoint", str(directory))[0] == 0
    code, out, err = _cli(
        capsys, "cnn", "--epochs", "2", "--zero", "2", "--checkpoint", str(directory), "--resume"
    )
    assert code == 2 and "epoch" not in out
    assert err == f"meshwise train: error: {directory}/run.json holds a 'mlp' run, not 'cnn'\n"
    gpt = tmp_path / "gpt"
    (gpt / "step-000004").mkdir(parents=True)
    (gpt / "run.json").write_text(json.dumps({"format": "meshwise-gpt/1", "step": 4}))
    code, _, err = _cli(capsys, "cnn", "--epochs", "2", "--checkpoint", str(gpt), "--resume")
    assert code == 2 and err == (
        f"meshwise train: error: {gpt}/run.json is not a meshwise training checkpoint "
        "(format 'meshwise-train/2' expected)\n"
    )
