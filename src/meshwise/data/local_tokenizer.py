"""Text tokenized with a local tokenizer file, for fine-tuning on one's own text: never a download.

``--tokenizer DIR|tokenizer.json`` (or the ``--init-from`` folder's ``tokenizer.json``) names a Hugging
Face ``tokenizers`` file; a text ``--data`` is then encoded with it once and cached beside the text as
``NAME.<digest>.bin`` (uint16 ids, the token-file layout of :mod:`meshwise.data.tokens`), so later runs
— and every rank of this one — map the cache instead of tokenizing again. The digest covers the
tokenizer file, so another tokenizer gets its own cache. ``--sample`` decodes with the same file.

The ``tokenizers`` package reads only the file given (``Tokenizer.from_file``); nothing is fetched.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from meshwise.data.tokens import TOKEN_DTYPE, TOKEN_SUFFIX, open_tokens

TOKENIZER_FILE = "tokenizer.json"


def tokenizer_file(path: str | Path) -> Path:
    """``path`` itself, or the ``tokenizer.json`` inside a folder; FileNotFoundError naming the flag."""
    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"--tokenizer {path}: no {TOKENIZER_FILE} there (give the file or its folder)"
        )
    return file


def load_tokenizer(path: str | Path):  # -> tokenizers.Tokenizer (optional dependency)
    """The tokenizer in ``path``, read from that file only."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError("--tokenizer needs the tokenizers package: pip install 'meshwise[hf]'") from None
    file = tokenizer_file(path)
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust side raises its own exception type for malformed files
        raise ValueError(f"--tokenizer {file} is not a tokenizers file ({exc})") from None


def cache_path(text: Path, tokenizer: Path) -> Path:
    digest = hashlib.sha256(tokenizer.read_bytes()).hexdigest()[:12]
    return text.with_name(f"{text.name}.{digest}{TOKEN_SUFFIX}")


def tokenize_cached(text: str | Path, tokenizer: str | Path) -> tuple[np.ndarray, Path]:
    """The ids of ``text`` under ``tokenizer`` (mapped from the cache, written first if missing or
    older than either file) and the cache's path."""
    text, file = Path(text), tokenizer_file(tokenizer)
    if not text.is_file():
        raise FileNotFoundError(f"--data {text} does not exist")
    cache = cache_path(text, file)
    newest = max(text.stat().st_mtime_ns, file.stat().st_mtime_ns)
    if not cache.is_file() or cache.stat().st_mtime_ns < newest:
        model = load_tokenizer(file)
        if model.get_vocab_size() > np.iinfo(TOKEN_DTYPE).max + 1:
            raise ValueError(f"--tokenizer {file} has {model.get_vocab_size():,} tokens; uint16 holds 65,536")
        ids = np.asarray(model.encode(text.read_text(encoding="utf-8")).ids, dtype=TOKEN_DTYPE)
        temporary = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")
        ids.tofile(temporary)
        os.replace(temporary, cache)  # ranks reading a half-written cache is impossible
    return open_tokens(cache), cache


class FileTokenizer:
    """Encode/decode with a local tokenizer, the interface of :class:`~meshwise.data.tokens.ByteTokenizer`."""

    def __init__(self, path: str | Path) -> None:
        self._tokenizer = load_tokenizer(path)

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size())

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text).ids, dtype=TOKEN_DTYPE)

    def decode(self, tokens: np.ndarray | list[int]) -> str:
        return str(self._tokenizer.decode([int(t) for t in tokens]))
