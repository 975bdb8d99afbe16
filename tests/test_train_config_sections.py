"""The training configs are plain data: every parser default is the section field's, one mapping turns
flat flags into sections, validation reads no file and no environment, and the resolve step reads them
once and fails in one clear line."""

from __future__ import annotations

import argparse
import builtins
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from meshwise.cli import build_parser
from meshwise.train import WORKLOADS, TrainConfig
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.resolve import resolve
from meshwise.train.sections import sections_of

#: parser dests that steer the command rather than the run (argparse's own, --auto, the retired --strategy)
NOT_SETTINGS = {"help", "func", "command", "model", "auto", "strategy"}


def _subparser(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def _defaults(parser: argparse.ArgumentParser) -> dict[str, object]:
    """Each setting's default as parsing nothing would give it (the first action of a dest sets it)."""
    seen: dict[str, object] = {}
    for action in parser._actions:
        if action.dest not in NOT_SETTINGS and action.dest not in seen:
            seen[action.dest] = action.default
    return seen


@pytest.mark.parametrize("model", ["gpt", *WORKLOADS])
def test_every_parser_default_is_the_dataclass_default(model: str) -> None:
    parser = _subparser(build_parser("train"), "train", model)
    config = GPTTrainConfig if model == "gpt" else TrainConfig
    assert _defaults(parser) == config.flag_defaults()  # the same flags, with the same defaults


@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_zero_is_one_flag_in_both_commands(model: str) -> None:
    parser = _subparser(build_parser("train"), "train", model)
    assert vars(parser.parse_args(["--zero", "2"]))["zero"] == 2


@pytest.mark.parametrize("config", [GPTTrainConfig, TrainConfig])
def test_no_two_sections_share_a_flag(config: type) -> None:
    names = [f.name for section in sections_of(config).values() for f in fields(section)]
    assert len(names) == len(set(names)) == len(config.flag_defaults())


def test_from_flags_is_the_one_mapping_to_sections() -> None:
    config = GPTTrainConfig.from_flags(tp=2, global_batch=4, lr=1e-3, checkpoint="ckpt", trace="t.json")
    assert (config.mesh.tp, config.data.global_batch, config.optimizer.lr) == (2, 4, 1e-3)
    assert (config.output.checkpoint, config.profile.trace) == ("ckpt", "t.json")
    assert config.with_flags(resume=True) == GPTTrainConfig.from_flags(
        tp=2, global_batch=4, lr=1e-3, checkpoint="ckpt", trace="t.json", resume=True
    )
    assert not config.output.resume
    with pytest.raises(TypeError, match="no_such_flag"):
        config.with_flags(no_such_flag=1)
    with pytest.raises(TypeError, match="no_such_flag"):
        GPTTrainConfig.from_flags(no_such_flag=1)
    mlp = TrainConfig.from_flags("cnn", zero=1, data_dir="mnist", debug=True)
    assert (mlp.model, mlp.mesh.zero, mlp.data.data_dir, mlp.profile.debug) == ("cnn", 1, "mnist", True)
    assert mlp.with_flags(model="mlp", seed=3) == TrainConfig.from_flags(
        "mlp", zero=1, data_dir="mnist", debug=True, seed=3
    )


class _NoEnvironment(Mapping[str, str]):
    """``os.environ`` while validating: any read is a failure."""

    def __getitem__(self, key: str) -> str:
        raise AssertionError(f"validate read the environment ({key})")

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("validate read the environment")

    def __len__(self) -> int:
        raise AssertionError("validate read the environment")


def _sealed(call: Callable[[], object]) -> BaseException | None:
    """Run ``call`` with no file, directory, environment variable or CUDA query reachable; return what it
    raised (reported after the machine is unsealed again, so the report itself can read files)."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"validate touched the machine: {args}")

    with pytest.MonkeyPatch.context() as patch:
        for module, name in (
            (builtins, "open"),
            (os, "stat"),
            (os, "listdir"),
            (os, "scandir"),
            (os, "access"),
        ):
            patch.setattr(module, name, refuse)
        patch.setattr(torch.cuda, "is_available", refuse)
        patch.setattr(os, "environ", _NoEnvironment())
        try:
            call()
        except BaseException as raised:  # handed back to the test to assert on
            return raised
    return None


def test_validate_reads_no_file_and_no_environment() -> None:
    missing = "/nonexistent/meshwise"
    gpt = GPTTrainConfig.from_flags(
        data=f"{missing}/corpus.txt", init_from=f"{missing}/model.safetensors", tokenizer=missing,
        checkpoint=missing, resume=True, export_hf=missing, torch_profile=missing, nproc=64, tp=2,
        device="cuda", tensorboard=missing,
    )  # fmt: skip
    assert _sealed(gpt.validate) is None
    mlp = TrainConfig.from_flags("cnn", data_dir=missing, checkpoint=missing, resume=True, device="cuda")
    assert _sealed(mlp.validate) is None
    assert isinstance(_sealed(lambda: Path(missing).exists()), AssertionError)  # the seal holds


def test_validate_still_refuses_what_the_flags_alone_contradict() -> None:
    refused = {
        "--min-lr 0.1 is above --lr 0.01": GPTTrainConfig.from_flags(lr=0.01, min_lr=0.1),
        "--schedule configure pipeline parallelism": GPTTrainConfig.from_flags(schedule="gpipe"),
        "--zero must be 0, 1, 2 or 3": TrainConfig.from_flags("mlp", zero=4),
    }
    for message, config in refused.items():
        raised = _sealed(config.validate)
        assert isinstance(raised, ValueError) and message in str(raised), (message, raised)


def test_resolve_names_a_missing_data_file_in_one_line(tmp_path) -> None:
    config = GPTTrainConfig.from_flags(data=str(tmp_path / "absent.txt"), backend="gloo")
    assert config.validate() is config  # nothing wrong with the flags themselves
    with pytest.raises(FileNotFoundError) as raised:
        resolve(config)
    assert "absent.txt" in str(raised.value) and "\n" not in str(raised.value)
