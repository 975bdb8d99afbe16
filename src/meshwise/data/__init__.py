"""Datasets (bundled digits, MNIST IDX files, synthetic clusters) and the distributed sampler."""

from meshwise.data.digits import load_digits
from meshwise.data.mnist import load_mnist, parse_idx, read_idx
from meshwise.data.sampler import REMAINDERS, DistributedSampler
from meshwise.data.synthetic import gaussian_clusters
from meshwise.data.tensors import Splits, TensorDataset, standardize

__all__ = [
    "REMAINDERS",
    "DistributedSampler",
    "Splits",
    "TensorDataset",
    "gaussian_clusters",
    "load_digits",
    "load_mnist",
    "parse_idx",
    "read_idx",
    "standardize",
]
