"""Every output path of ``train gpt`` is probed with a real write before any rank starts (issue 30.2)."""

from __future__ import annotations

import pytest

from gpt_cli import gpt_argv, one_line, refuse_ranks
from meshwise.cli import main


@pytest.mark.parametrize(
    "flag, path",
    [
        ("--checkpoint", "/proc/meshwise-ckpt"),
        ("--export-hf", "/proc/meshwise-hf"),
        ("--trace", "/proc/meshwise-trace.json"),
        ("--torch-profile", "/proc/meshwise-profile"),
        ("--json", "/proc/meshwise.json"),
        ("--timeline", "/proc/meshwise-timeline.png"),
    ],
)
def test_an_unwritable_output_is_refused_before_any_rank_starts(text, capsys, monkeypatch, flag, path):
    """/proc refuses writes even to root, for whom permission bits (os.access) say yes: a real write."""
    refuse_ranks(monkeypatch)
    extra = ["--pp", "2", "-np", "2"] if flag == "--timeline" else []
    assert main(gpt_argv(text, "--steps", "2", *extra, flag, path)) == 2
    err = one_line(capsys.readouterr().err)
    assert flag in err and path in err
