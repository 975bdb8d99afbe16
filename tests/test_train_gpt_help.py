"""``train gpt --help`` answers what a new user asks (issue 30.9): every default, plain text, a micro-batch
size that cannot be mistaken for a count, ``zb`` named, and ``--nproc-per-node`` as in ``meshwise run``."""

from __future__ import annotations

import argparse

import pytest

from meshwise.cli import build_parser


def _gpt_parser() -> argparse.ArgumentParser:
    def sub(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return action.choices[name]

    return sub(sub(build_parser("train"), "train"), "gpt")


def test_every_option_that_takes_a_value_shows_its_default():
    missing = [
        action.option_strings[-1]
        for action in _gpt_parser()._actions
        if action.nargs != 0 and action.help != argparse.SUPPRESS and "default" not in (action.help or "")
    ]
    assert not missing, f"no default in the help of {missing}"


def test_the_help_is_plain_text_and_names_zb_and_the_micro_batch_size():
    text = _gpt_parser().format_help()
    assert "``" not in text
    assert "ZB-H1" in text and "--micro-batch-size SIZE" in text and "--micro-batches COUNT" in text
    assert "--micro-batch " not in text  # the old spelling, one letter from --micro-batches, is not shown


@pytest.mark.parametrize(
    "argv, dest, value",
    [
        (["--nproc-per-node", "4"], "nproc", 4),
        (["--micro-batch-size", "2"], "micro_batch", 2),
        (["--micro-batch", "2"], "micro_batch", 2),
    ],
)
def test_spellings_users_bring_from_other_tools_are_accepted(argv, dest, value):
    assert getattr(build_parser("train").parse_args(["train", "gpt", *argv]), dest) == value
