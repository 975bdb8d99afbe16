"""Token streams: a byte-level tokenizer and flat ``uint16`` token files, memory-mapped.

The file layout is the common one (nanoGPT's ``train.bin``, llm.c's shards without their header): token
ids as little-endian ``uint16``, back to back, nothing else. A corpus tokenized elsewhere (GPT-2's BPE has
50,257 ids, which fit) is used as is; the file is mapped, not read, so a corpus larger than memory costs
only the pages a batch touches. Raw text is tokenized to bytes (ids 0..255), which needs no vocabulary
file and learns quickly enough on a CPU to show a model learning.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

TOKEN_DTYPE = np.dtype("<u2")
#: ``--data`` files with this suffix are token files; anything else is read as text.
TOKEN_SUFFIX = ".bin"


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, lossless for any text."""

    vocab = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(TOKEN_DTYPE)

    def decode(self, tokens: np.ndarray | list[int]) -> str:
        """Text of byte tokens; bytes that do not form valid UTF-8 (a sample cut mid-character, ids of a
        larger vocabulary) show as U+FFFD rather than failing."""
        ids = np.asarray(tokens, dtype=np.int64)
        return bytes(int(t) for t in ids if 0 <= t < 256).decode("utf-8", errors="replace")


def write_tokens(path: str | Path, tokens: np.ndarray) -> Path:
    """Write ``tokens`` as a flat uint16 file, via a temporary file renamed into place (a reader never
    sees a half-written file, and concurrent writers of the same content are harmless)."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(TOKEN_DTYPE).max):
        raise ValueError("token ids must be in 0..65535 to fit the uint16 file layout")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{np.random.default_rng().integers(1 << 62)}.tmp")
    try:
        tokens.astype(TOKEN_DTYPE).tofile(temporary)
        temporary.replace(path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def open_tokens(path: str | Path) -> np.ndarray:
    """The token file at ``path``, memory-mapped read-only; a clear error for a missing or torn file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {path} does not exist")
    size = path.stat().st_size
    if size % TOKEN_DTYPE.itemsize:
        raise ValueError(
            f"--data {path} has {size} bytes, an odd number: a token file holds 2-byte uint16 ids "
            "(truncated file, or text with a .bin name?)"
        )
    if size == 0:
        raise ValueError(f"--data {path} is empty")
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")


def load_tokens(path: str | Path) -> np.ndarray:
    """``--data PATH``: a ``.bin`` token file (mapped), or any other file read as UTF-8 text → bytes."""
    path = Path(path)
    if path.suffix == TOKEN_SUFFIX:
        return open_tokens(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {path} does not exist")
    return np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(TOKEN_DTYPE)
