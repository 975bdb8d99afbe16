"""In-memory datasets: every reference dataset fits in memory, so batches are index lookups, not a
DataLoader's per-sample collation (which would cost more than the models' own steps)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorDataset:
    """``inputs[i]`` and ``targets[i]`` form sample i."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __post_init__(self) -> None:
        if self.inputs.shape[0] != self.targets.shape[0]:
            raise ValueError(
                f"{self.inputs.shape[0]} inputs but {self.targets.shape[0]} targets: they must pair up"
            )

    def __len__(self) -> int:
        return self.inputs.shape[0]


@dataclass(frozen=True)
class Splits:
    """A named classification dataset: training and validation parts and the number of classes."""

    name: str
    train: TensorDataset
    val: TensorDataset
    classes: int

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.train.inputs.shape[1:])


def standardize(splits: Splits) -> Splits:
    """Shift and scale inputs to zero mean and unit variance, with the training part's statistics (the
    validation part must not leak into them)."""
    mean, std = splits.train.inputs.mean(), splits.train.inputs.std().clamp_min(1e-12)

    def scaled(part: TensorDataset) -> TensorDataset:
        return TensorDataset((part.inputs - mean) / std, part.targets)

    return Splits(splits.name, scaled(splits.train), scaled(splits.val), splits.classes)
