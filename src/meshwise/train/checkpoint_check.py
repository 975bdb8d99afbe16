"""Is a DCP checkpoint directory intact? Checked before any rank starts a ``--resume``, reading only.

A checkpoint damaged on disk (a copy cut short, a flipped bit, a lost file) used to surface as a
100-line traceback from every rank, one of them ending in torch's advice to load with
``weights_only=False`` — advice never to follow for a file that is already not what was written. This
check reads the directory the way a load would, without building any tensor, and answers in one line
naming the damaged file:

- ``.metadata`` must exist and unpickle through an allow-list of DCP's own metadata classes (a
  restricted unpickler: a damaged or foreign file cannot run code here, whatever it contains);
- every storage item it lists must lie inside its ``.distcp`` file (a truncated file is named);
- every item written by ``torch.save`` is a zip archive whose CRC-32 checksums are verified, which
  catches flipped bytes anywhere in the tensor data.

The cost is one sequential read of the checkpoint plus CRC-32 (GB/s), far less than the load it
guards; it never changes what or how checkpoints are written.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

METADATA = ".metadata"
#: modules whose classes a DCP ``.metadata`` file may name (all of them plain records)
_DCP_MODULES = ("torch.distributed.checkpoint.",)
#: single names outside them that DCP pickles: tensor sizes, dtypes' and layouts' rebuilders, paths
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class DamagedCheckpointError(ValueError):
    """A checkpoint file is missing or not what was written; the message names the file."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = module.startswith(_DCP_MODULES) or (module, name) in _ALLOWED
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP metadata never holds")
        return super().find_class(module, name)


def _damaged(path: Path, what: str) -> DamagedCheckpointError:
    return DamagedCheckpointError(
        f"checkpoint file {path} {what}: the checkpoint is damaged; restore the directory from a copy, "
        "or start without --resume"
    )


def read_metadata(directory: str | Path) -> Any:
    """The DCP ``Metadata`` of ``directory``, read through the allow-list above."""
    path = Path(directory) / METADATA
    if not path.is_file():
        raise _damaged(path, "is missing")
    try:
        with path.open("rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except Exception as exc:  # truncated, garbage, or a foreign pickle: all the same to the user
        raise _damaged(path, f"is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(getattr(metadata, "storage_data", None), dict):
        raise _damaged(path, "is not DCP metadata (no storage index)")
    return metadata


def check_dcp_checkpoint(directory: str | Path) -> None:
    """Raise :class:`DamagedCheckpointError` naming the first damaged file of the DCP checkpoint in
    ``directory``; return quietly when every item its metadata lists is present and intact."""
    directory = Path(directory)
    metadata = read_metadata(directory)
    items: dict[str, list[tuple[int, int]]] = {}
    for info in metadata.storage_data.values():
        items.setdefault(str(info.relative_path), []).append((int(info.offset), int(info.length)))
    for name, ranges in sorted(items.items()):
        path = directory / name
        if not path.is_file():
            raise _damaged(path, "is missing")
        data = path.read_bytes()
        end = max(offset + length for offset, length in ranges)
        if len(data) < end:
            raise _damaged(path, f"is truncated ({len(data):,} bytes, the metadata lists {end:,})")
        for offset, length in ranges:
            _check_item(path, data[offset : offset + length], offset)


def _check_item(path: Path, item: bytes, offset: int) -> None:
    """An item ``torch.save`` wrote is a zip archive: its structure and every member's CRC-32."""
    if not item.startswith(b"PK"):
        return  # raw bytes (another serialization format): the length check is all there is
    try:
        with zipfile.ZipFile(io.BytesIO(item)) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise _damaged(path, f"has a corrupt item at byte {offset:,} ({exc})") from None
    if bad is not None:
        raise _damaged(path, f"has a checksum mismatch in the item at byte {offset:,} ({bad})")
