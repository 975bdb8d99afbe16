"""Every command's help reads as plain text: no reStructuredText markup, no word only the lecture notes
define, and `meshwise run`'s missing-script message says what is true of the path it was given."""

import pytest

from meshwise.cli import COMMANDS, build_parser, main


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_texts_are_plain(command, capsys):
    argv = ["--help"] if command is None else [command, "--help"]
    with pytest.raises(SystemExit):
        build_parser(command).parse_args(argv)
    text = capsys.readouterr().out
    assert text.strip()
    for markup in ("``", ":func:", ":class:", ":mod:", "seeds'"):
        assert markup not in text, (command, markup)


def test_missing_script_message_fits_the_path(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["run", "-n", "2", "/nonexistent/train.py"]) == 2
    err = capsys.readouterr().err
    assert "script '/nonexistent/train.py' does not exist" in err and "relative to" not in err
    assert main(["run", "-n", "2", "train.py"]) == 2
    assert f"script 'train.py' does not exist (relative to {tmp_path})" in capsys.readouterr().err
