"""Output files checked before the work that fills them, and written one by one.

A benchmark or training run that ends with a traceback because ``--json`` names a missing directory, or
``--plot`` a format matplotlib cannot write, has wasted the whole run. Every command that writes files
calls :func:`check_output` / :func:`check_plot` while it validates its options, and :func:`write_outputs`
at the end, so that one failed write neither hides the others nor turns into a traceback.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def check_output(option: str, path: str | None) -> None:
    """Raise ValueError unless ``path`` can be created or replaced (its directory exists and is writable;
    it is not a directory). ``None`` and ``-`` (stdout) pass."""
    if path is None or path == "-":
        return
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{option} {path} is a directory; give a file name")
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(
            f"{option} {path}: directory {parent} does not exist; create it or choose another path"
        )
    if not os.access(parent, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"{option} {path}: not writable; choose another path")


def probe_file(option: str, path: str | None) -> None:
    """:func:`check_output`, then a real scratch write beside ``path``: permission bits do not tell
    (root passes every ``os.access``; read-only mounts, /proc and full disks refuse anyway)."""
    check_output(option, path)
    if path is None or path == "-":
        return
    _scratch_write(option, path, Path(path).parent if str(Path(path).parent) else Path("."))


def probe_directory(option: str, path: str | None) -> None:
    """Raise ValueError unless ``path`` is, or can be created as, a directory files can be written
    into: a scratch file in it, or a scratch directory where it would be created (nothing is left)."""
    if path is None:
        return
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{option} {path} is a file; name a directory (it is created if missing)")
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{option} {path} is not writable ({existing} is a file); choose another path")
    _scratch_write(option, path, existing)


def _scratch_write(option: str, path: str, directory: Path) -> None:
    try:
        with tempfile.TemporaryDirectory(dir=directory, prefix=".meshwise-probe-") as scratch:
            (Path(scratch) / "probe").write_bytes(b"meshwise")
    except OSError as exc:
        raise ValueError(
            f"{option} {path} is not writable ({exc.strerror or exc} in {directory}); choose another path"
        ) from None


def plot_formats() -> dict[str, str]:
    """File extensions matplotlib can write here (``png`` → ``Portable Network Graphics``, …)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    return dict(FigureCanvasAgg.get_supported_filetypes())


def check_plot(option: str, path: str | None) -> None:
    """:func:`check_output`, plus matplotlib installed and a file extension it writes."""
    if path is None:
        return
    try:
        formats = plot_formats()
    except ImportError:
        raise ValueError(f"{option} needs matplotlib: pip install 'meshwise[plot]'") from None
    extension = Path(path).suffix.lower().lstrip(".")
    if extension not in formats:
        raise ValueError(
            f"{option} {path}: unknown image format {'.' + extension if extension else '(no extension)'}; "
            f"end the name with one of {', '.join('.' + e for e in sorted(formats))}"
        )
    probe_file(option, path)


def write_outputs(command: str, writers: list[tuple[str, str, Callable[[], None]]]) -> bool:
    """Run each ``(what, path, write)`` and say ``# what written to path``; a failure is one line on
    stderr and the next output is still written. True if all succeeded (checked paths can still fail:
    a full disk, a directory removed during the run)."""
    ok = True
    for what, path, write in writers:
        try:
            write()
        except OSError as exc:
            reason = exc.strerror or exc
            print(f"meshwise {command}: error: could not write {path}: {reason}", file=sys.stderr)
            ok = False
        else:
            print(f"# {what} written to {path}", flush=True)
    return ok


def finish_training(command: str, result: Any, json_path: str | None) -> int:
    """The end of every ``meshwise train`` flavour: rank 0 prints the summary and writes ``--json``; a
    launched rank other than 0 (``result`` None) exits quietly. The exit code of the command."""
    if result is None:
        return 0
    print(result.summary(), flush=True)
    text = json.dumps({"complete": True, **result.to_json()}, indent=2) + "\n"
    writers = [("JSON", json_path, lambda: Path(json_path).write_text(text))] if json_path else []
    return 0 if write_outputs(command, writers) else 1
