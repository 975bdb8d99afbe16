"""A damaged ``train gpt`` checkpoint is named in one line before any rank starts, never loaded unsafely
(issue 30.3): each kind of damage a disk, a copy or a crash leaves, made to a real checkpoint."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest

from gpt_cli import gpt_argv, one_line, refuse_ranks
from meshwise.cli import main
from meshwise.train.checkpoint_check import DamagedCheckpointError, read_metadata


@pytest.fixture(scope="module")
def checkpoint(text, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt") / "run"
    assert main(gpt_argv(text, "--steps", "2", "--eval-every", "2", "--checkpoint", str(directory))) == 0
    return directory


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path: Path) -> None:
    """Flip a byte in the middle of the file's largest item: inside a tensor's bytes (a zip member's
    data, not its padding), which only a checksum can tell."""
    items = read_metadata(path.parent).storage_data.values()
    largest = max((i for i in items if str(i.relative_path) == path.name), key=lambda i: int(i.length))
    data = bytearray(path.read_bytes())
    data[int(largest.offset) + int(largest.length) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated .distcp": ("__0_0.distcp", _truncate),
    "flipped byte in .distcp": ("__0_0.distcp", _flip),
    "missing .distcp": ("__0_0.distcp", Path.unlink),
    "garbage .metadata": (".metadata", lambda p: p.write_bytes(b"\x80\x04garbage" * 10)),
    "missing .metadata": (".metadata", Path.unlink),
    "truncated .metadata": (".metadata", _truncate),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_one_line_naming_the_file(
    text, checkpoint, tmp_path, capsys, monkeypatch, damage
):
    refuse_ranks(monkeypatch)
    copy = tmp_path / "run"
    shutil.copytree(checkpoint, copy)
    name, spoil = DAMAGE[damage]
    (step_dir,) = copy.glob("step-*")
    spoil(step_dir / name)
    assert (
        main(gpt_argv(text, "--steps", "4", "--eval-every", "2", "--checkpoint", str(copy), "--resume")) == 2
    )
    err = one_line(capsys.readouterr().err)
    assert str(step_dir / name) in err


def test_an_intact_checkpoint_passes_the_check(text, checkpoint, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(checkpoint, copy)
    assert (
        main(gpt_argv(text, "--steps", "3", "--eval-every", "2", "--checkpoint", str(copy), "--resume")) == 0
    )


def test_the_metadata_reader_runs_no_foreign_code(tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("ran",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(DamagedCheckpointError, match=r"builtins\.print"):
        read_metadata(tmp_path)
