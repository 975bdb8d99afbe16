"""Datasets and the distributed sampler, without processes."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.utils.data

from meshwise.data import (
    DistributedSampler,
    gaussian_clusters,
    load_digits,
    load_mnist,
    parse_idx,
    read_idx,
    standardize,
)
from meshwise.data.mnist import MNIST_FILES

# ---------------------------------------------------------------------------------------------- sampler
SIZES = [(10, 3, "pad"), (12, 4, "pad"), (7, 2, "pad"), (3, 4, "pad"), (1024, 3, "pad")]
SIZES += [(10, 3, "drop"), (12, 4, "drop"), (7, 2, "drop"), (5, 5, "drop")]


@pytest.mark.parametrize("size,replicas,remainder", SIZES)
@pytest.mark.parametrize("shuffle", [True, False])
def test_same_shards_as_torch_distributed_sampler(size, replicas, remainder, shuffle):
    for rank in range(replicas):
        ours = DistributedSampler(size, replicas, rank, shuffle=shuffle, seed=7, remainder=remainder)
        theirs = torch.utils.data.DistributedSampler(
            range(size), replicas, rank, shuffle=shuffle, seed=7, drop_last=remainder == "drop"
        )
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


def _shards(size: int, replicas: int, remainder: str, epoch: int = 0) -> list[list[int]]:
    shards = []
    for rank in range(replicas):
        sampler = DistributedSampler(size, replicas, rank, seed=1, remainder=remainder)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards


def test_pad_gives_every_rank_the_same_count_and_sees_every_sample():
    shards = _shards(10, 4, "pad")
    assert [len(s) for s in shards] == [3, 3, 3, 3]
    flat = [i for s in shards for i in s]
    assert set(flat) == set(range(10)) and len(flat) - len(set(flat)) == 2  # two samples seen twice


def test_drop_leaves_out_the_remainder_and_never_repeats():
    shards = _shards(10, 4, "drop")
    flat = [i for s in shards for i in s]
    assert [len(s) for s in shards] == [2, 2, 2, 2] and len(set(flat)) == 8


def test_uneven_takes_every_sample_exactly_once():
    shards = _shards(10, 4, "uneven")
    assert [len(s) for s in shards] == [3, 3, 2, 2]
    assert sorted(i for s in shards for i in s) == list(range(10))


def test_set_epoch_reshuffles_and_is_reproducible():
    assert _shards(100, 2, "pad", epoch=1) != _shards(100, 2, "pad", epoch=2)
    assert _shards(100, 2, "pad", epoch=1) == _shards(100, 2, "pad", epoch=1)


def test_padding_wraps_around_more_than_once_for_tiny_datasets():
    shards = _shards(2, 5, "pad")
    assert all(len(s) == 1 for s in shards) and {i for s in shards for i in s} == {0, 1}


def test_state_dict_restores_seed_and_epoch():
    sampler = DistributedSampler(50, 2, 1, seed=5)
    sampler.set_epoch(4)
    restored = DistributedSampler(50, 2, 1, seed=0)
    restored.load_state_dict(sampler.state_dict())
    assert list(restored) == list(sampler) and restored.state_dict() == {"seed": 5, "epoch": 4}


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"size": 10, "num_replicas": 0, "rank": 0}, "num_replicas"),
        ({"size": 10, "num_replicas": 2, "rank": 2}, "outside"),
        ({"size": 10, "num_replicas": 2, "rank": 0, "remainder": "wrap"}, "remainder"),
        ({"size": 0, "num_replicas": 2, "rank": 0}, "leaves ranks empty"),
        ({"size": 3, "num_replicas": 4, "rank": 0, "remainder": "drop"}, "leaves ranks empty"),
    ],
)
def test_bad_sampler_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistributedSampler(**kwargs)


def test_negative_epoch_is_refused():
    with pytest.raises(ValueError, match="non-negative"):
        DistributedSampler(10, 2, 0).set_epoch(-1)


# ---------------------------------------------------------------------------------------------- datasets
def test_bundled_digits_are_the_uci_test_set_split_80_20():
    splits = load_digits()
    assert (len(splits.train), len(splits.val)) == (1438, 359)
    assert splits.sample_shape == (1, 8, 8) and splits.classes == 10
    assert splits.train.inputs.min() == 0 and splits.train.inputs.max() == 1
    counts = torch.bincount(torch.cat([splits.train.targets, splits.val.targets]), minlength=10)
    assert counts.sum() == 1797 and counts.min() >= 174  # balanced: 174..183 per digit
    again = load_digits()
    assert torch.equal(again.val.inputs, splits.val.inputs)  # the split does not depend on any seed


def test_standardize_uses_training_statistics_only():
    splits = standardize(load_digits())
    assert abs(splits.train.inputs.mean().item()) < 1e-5 and abs(splits.train.inputs.std().item() - 1) < 1e-5
    assert abs(splits.val.inputs.mean().item()) > 1e-5  # validation is shifted by the training mean


def test_gaussian_clusters_are_reproducible_and_learnable_by_a_linear_rule():
    a, b = gaussian_clusters(1024, 6, 2, seed=3), gaussian_clusters(1024, 6, 2, seed=3)
    assert torch.equal(a.train.inputs, b.train.inputs) and a.train.inputs.shape == (1024, 6)
    assert len(a.val) == 256 and set(a.train.targets.tolist()) == {0, 1}
    # nearest-centre classification with centres estimated on train reaches well above chance on val
    centres = torch.stack([a.train.inputs[a.train.targets == c].mean(0) for c in (0, 1)])
    predicted = torch.cdist(a.val.inputs, centres).argmin(1)
    assert (predicted == a.val.targets).float().mean() > 0.9


def test_gaussian_clusters_refuse_degenerate_sizes():
    with pytest.raises(ValueError, match="classes"):
        gaussian_clusters(10, 6, 1)


# ---------------------------------------------------------------------------------------------- MNIST IDX
def _idx(array: np.ndarray, code: int = 0x08) -> bytes:
    header = bytes([0, 0, code, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_mnist(directory: Path, images: int = 6, gz: bool = True, side: int = 28) -> None:
    """Four small MNIST-layout IDX files (random images, labels 0, 1, 2, ...) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for images_stem, labels_stem in MNIST_FILES.values():
        for stem, data in (
            (images_stem, _idx(rng.integers(0, 256, (images, side, side), dtype=np.uint8))),
            (labels_stem, _idx(np.arange(images, dtype=np.uint8) % 10)),
        ):
            path = directory / (f"{stem}.gz" if gz else stem)
            path.write_bytes(gzip.compress(data) if gz else data)


def test_parse_idx_reads_every_idx_type_big_endian():
    for code, dtype in (
        (0x08, np.uint8),
        (0x09, np.int8),
        (0x0B, np.int16),
        (0x0C, np.int32),
        (0x0D, np.float32),
    ):
        array = np.arange(24, dtype=dtype).reshape(2, 3, 4)
        assert np.array_equal(parse_idx(_idx(array, code)), array)


@pytest.mark.parametrize("gz", [True, False])
def test_load_mnist_from_raw_or_gzipped_files(tmp_path, gz):
    write_mnist(tmp_path, gz=gz)
    splits = load_mnist(tmp_path)
    assert splits.train.inputs.shape == (6, 1, 28, 28) and splits.val.targets.tolist() == [0, 1, 2, 3, 4, 5]
    assert splits.train.inputs.min() >= 0 and splits.train.inputs.max() <= 1


def test_load_mnist_finds_torchvisions_layout(tmp_path):
    write_mnist(tmp_path / "MNIST" / "raw")
    assert len(load_mnist(tmp_path).train) == 6


def test_missing_mnist_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_mnist(tmp_path / "nowhere")
    write_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        load_mnist(tmp_path)


@pytest.mark.parametrize(
    "damage,match",
    [
        (lambda data: b"\x08\x03" + data[2:], "not an IDX file"),
        (lambda data: data[:-10], "truncated or corrupt"),
        (lambda data: data[:6], "truncated inside its header"),
        (lambda data: b"", "not an IDX file"),
    ],
)
def test_corrupt_idx_data_is_refused(damage, match):
    data = _idx(np.zeros((2, 4, 4), dtype=np.uint8))
    with pytest.raises(ValueError, match=match):
        parse_idx(damage(data))


def test_corrupt_gzip_and_mismatched_files_name_the_file(tmp_path):
    write_mnist(tmp_path)
    broken = tmp_path / "train-images-idx3-ubyte.gz"
    broken.write_bytes(broken.read_bytes()[:40])
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte\.gz cannot be read as gzip"):
        read_idx(broken)
    write_mnist(tmp_path)
    labels = tmp_path / "train-labels-idx1-ubyte.gz"
    labels.write_bytes(gzip.compress(_idx(np.arange(5, dtype=np.uint8))))
    with pytest.raises(ValueError, match=r"6 images but .* 5 labels"):
        load_mnist(tmp_path)
    labels.write_bytes(gzip.compress(_idx(np.full(6, 12, dtype=np.uint8))))
    with pytest.raises(ValueError, match=r"outside 0\.\.9"):
        load_mnist(tmp_path)
