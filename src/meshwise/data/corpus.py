"""The default corpus: this Python installation's own standard library source, built once and cached.

It exists offline on every machine that runs meshwise, is plenty (tens of MB) for models that train on a
CPU, and is text a reader can judge a sample of at a glance. Licence: the Python standard library is
distributed under the PSF License Agreement (Python Software Foundation); the corpus is built on the
user's machine from the copy they already have and is never redistributed by meshwise.

The files are read in sorted path order (test suites and bundled third-party code left out) up to
:data:`MAX_BYTES`, so two machines with the same Python version build the same corpus. The byte tokens
are written as a flat uint16 token file in the cache directory (``$XDG_CACHE_HOME/meshwise`` or
``~/.cache/meshwise``), keyed by the Python version, and later runs only map it.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

import numpy as np

from meshwise.data.tokens import open_tokens, write_tokens

MAX_BYTES = 24 * 2**20
NAME = "python-stdlib"
LICENCE = "PSF License Agreement (Python standard library source)"
_SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__", "turtledemo"}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "meshwise"


def corpus_path(directory: str | Path | None = None) -> Path:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return Path(directory or cache_dir()) / f"{NAME}-{version}.bin"


def source_files(root: str | Path | None = None) -> list[Path]:
    """The stdlib's ``.py`` files in sorted relative-path order, without tests and vendored code."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        if not _SKIP.intersection(path.relative_to(root).parts[:-1]):
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def build_corpus(path: Path, root: str | Path | None = None, max_bytes: int = MAX_BYTES) -> Path:
    """Concatenate the stdlib sources (one blank line between files) into the token file ``path``."""
    chunks, total = [], 0
    for file in source_files(root):
        data = file.read_bytes() + b"\n\n"
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total == 0:
        raise FileNotFoundError(
            "no Python standard library sources were found to build the default corpus: pass --data PATH "
            "(a text file or a uint16 .bin token file)"
        )
    return write_tokens(path, np.frombuffer(b"".join(chunks), dtype=np.uint8))


def default_corpus(directory: str | Path | None = None) -> np.ndarray:
    """The cached corpus, memory-mapped; built first if this machine does not have it yet."""
    path = corpus_path(directory)
    if not path.is_file():
        build_corpus(path)
    return open_tokens(path)
