"""Handwritten digits that work offline: the UCI optical-recognition digits, bundled with meshwise.

1797 images of 8×8 pixels with 17 grey levels (0..16), 10 balanced classes: the copy scikit-learn ships
as ``load_digits``, stored here as a 45 KB compressed ``.npz`` (see ``bundled/DIGITS.md``) so training
needs neither a download nor scikit-learn. Small enough that the seeds' CNN exercise runs in seconds on a
laptop CPU, real enough that accuracy means something.
"""

from __future__ import annotations

from importlib import resources

import numpy as np
import torch

from meshwise.data.tensors import Splits, TensorDataset

VAL_FRACTION = 0.2
_SPLIT_SEED = 1234  # fixed: the validation set must not change with the training seed


def load_digits() -> Splits:
    """The bundled digits as (N, 1, 8, 8) float images in [0, 1], split 80/20 by a fixed permutation."""
    with resources.files("meshwise.data").joinpath("bundled/digits.npz").open("rb") as handle:
        arrays = np.load(handle)
        images, labels = arrays["images"], arrays["labels"]
    inputs = torch.from_numpy(images.astype(np.float32) / 16.0).unsqueeze(1)
    targets = torch.from_numpy(labels.astype(np.int64))
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(_SPLIT_SEED))
    cut = len(targets) - round(len(targets) * VAL_FRACTION)
    train, val = order[:cut], order[cut:]
    return Splits(
        "digits", TensorDataset(inputs[train], targets[train]), TensorDataset(inputs[val], targets[val]), 10
    )
