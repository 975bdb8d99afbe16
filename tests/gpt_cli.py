"""What the ``meshwise train gpt`` command tests share: a tiny run's arguments, and checks that an answer
came before any rank started and is one line."""

from __future__ import annotations

import pytest

TINY = ["--config", "gpt-tiny", "--seq-len", "32", "--global-batch", "4", "--eval-windows", "4"]


def gpt_argv(text: str, *extra: str, backend: str = "gloo") -> list[str]:
    """``meshwise train gpt`` on gpt-tiny over ``text``, plus ``extra``."""
    return ["train", "gpt", *TINY, "--data", text, "--backend", backend, *extra]


def refuse_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any rank start fail the test: the check under test must answer before that."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("a rank started")

    monkeypatch.setattr("meshwise.train.errors.run_on_ranks", refuse)


def one_line(err: str) -> str:
    """``err`` when it is exactly one line, with no traceback and no advice to load unsafely."""
    assert err.count("\n") == 1, err
    assert "Traceback" not in err and "weights_only" not in err, err
    return err
