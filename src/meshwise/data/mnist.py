"""Read MNIST from the standard IDX files a user already has (raw or gzipped); nothing is downloaded.

IDX layout (LeCun's format): two zero bytes, a type code (0x08 unsigned byte, 0x09 signed byte,
0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64), the number of dimensions, each dimension as a
big-endian uint32, then the data in row-major big-endian order. Every way a file can be wrong (missing,
not IDX, truncated, labels not matching images) becomes an error that names the file.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np
import torch

from meshwise.data.tensors import Splits, TensorDataset

IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "val": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def parse_idx(data: bytes, name: str = "IDX data") -> np.ndarray:
    """The array stored in an IDX byte string."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in IDX_TYPES:
        raise ValueError(f"{name} is not an IDX file (bad magic number {data[:4].hex() or 'empty'})")
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{name} is truncated inside its header")
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(IDX_TYPES[data[2]])
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        raise ValueError(
            f"{name} holds {len(data)} bytes but its header {shape} of {dtype} needs {expected}: "
            "the file is truncated or corrupt"
        )
    return np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file; a ``.gz`` suffix means gzip."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        data = gzip.decompress(raw) if path.suffix == ".gz" else raw
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        if isinstance(exc, FileNotFoundError):
            raise
        raise ValueError(
            f"{path} cannot be read as {'gzip' if path.suffix == '.gz' else 'IDX'}: {exc}"
        ) from None
    return parse_idx(data, str(path))


def find_mnist_file(directory: Path, stem: str) -> Path:
    """``stem`` or ``stem.gz`` in ``directory`` or torchvision's ``MNIST/raw`` below it."""
    for folder in (directory, directory / "MNIST" / "raw"):
        for candidate in (folder / stem, folder / f"{stem}.gz"):
            if candidate.is_file():
                return candidate
    raise FileNotFoundError(
        f"MNIST file {stem}[.gz] not found in {directory} (nor in {directory / 'MNIST' / 'raw'}); the "
        f"directory needs {', '.join(s for pair in MNIST_FILES.values() for s in pair)}, raw or gzipped"
    )


def find_mnist_files(directory: str | Path) -> dict[str, tuple[Path, Path]]:
    """The (images, labels) files of each part, ``train`` and ``val``, all checked to exist."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"MNIST directory {directory} does not exist")
    return {
        part: (find_mnist_file(directory, images), find_mnist_file(directory, labels))
        for part, (images, labels) in MNIST_FILES.items()
    }


def _part(images_path: Path, labels_path: Path) -> TensorDataset:
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or labels.ndim != 1:
        raise ValueError(
            f"{images_path} must hold N×H×W images and {labels_path} N labels; got shapes "
            f"{images.shape} and {labels.shape}"
        )
    if len(images) != len(labels):
        raise ValueError(f"{images_path} holds {len(images)} images but {labels_path} {len(labels)} labels")
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        raise ValueError(f"{labels_path} holds labels outside 0..9 ({labels.min()}..{labels.max()})")
    inputs = torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1)
    return TensorDataset(inputs, torch.from_numpy(labels.astype(np.int64)))


def load_mnist(directory: str | Path) -> Splits:
    """MNIST from ``directory``: the 60k training images for training, the 10k test images to validate."""
    files = find_mnist_files(directory)
    train, val = _part(*files["train"]), _part(*files["val"])
    if train.inputs.shape[1:] != val.inputs.shape[1:]:
        raise ValueError(
            f"training images are {tuple(train.inputs.shape[2:])} but test images "
            f"{tuple(val.inputs.shape[2:])}: the files come from different datasets"
        )
    return Splits("mnist", train, val, 10)
