"""``train gpt`` has no job deadline unless the user sets one; then exit 124 naming the flag (issue 30.1)."""

from __future__ import annotations

import pytest

from gpt_cli import gpt_argv
from meshwise.cli import build_parser, main
from meshwise.runtime.timeouts import DEFAULT_TIMEOUT_S
from meshwise.train.gpt import GPTTrainConfig


def test_training_has_no_job_deadline_by_default_but_keeps_the_hang_timeout():
    args = build_parser("train").parse_args(["train", "gpt"])
    assert args.timeout is None
    config = GPTTrainConfig(timeout=args.timeout)
    assert config.comm_timeout == DEFAULT_TIMEOUT_S  # a dead peer is still named within minutes
    assert GPTTrainConfig(timeout=30.0).comm_timeout == 30.0


@pytest.mark.parametrize("ranks", ["1", "2"])
def test_a_deadline_the_user_sets_names_the_flag_and_exits_124(text, capsys, ranks):
    code = main(gpt_argv(text, "-np", ranks, "--steps", "100000", "--timeout", "3"))
    assert code == 124
    err = capsys.readouterr().err
    assert "--timeout 3" in err and "Traceback" not in err
