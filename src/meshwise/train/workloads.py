"""What ``meshwise train MODEL`` trains: each model with its data, optimizer and default settings.

Defaults are per rank (``batch_size``) and per single rank (``lr``): with W ranks the global batch is W
times larger and, unless disabled, the learning rate too (the linear scaling rule of the seeds' MNIST
exercise). AdamW with a cosine decay to zero makes every workload converge without per-size tuning.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from meshwise.data import Splits, gaussian_clusters, load_digits, load_mnist, standardize
from meshwise.models import DeepMLP, SmallCNN, TinyMLP


@dataclass(frozen=True)
class Workload:
    """A model, the data it learns and the settings that make it converge."""

    name: str
    summary: str
    epochs: int
    batch_size: int
    lr: float
    build_model: Callable[[Splits], nn.Module]
    load_data: Callable[[str | None], Splits]  # called with --data (None unless accepts_data_dir)
    accepts_data_dir: bool = False


def _images(data_dir: str | None) -> Splits:
    return standardize(load_digits() if data_dir is None else load_mnist(data_dir))


WORKLOADS: dict[str, Workload] = {
    "mlp": Workload(
        "mlp",
        "the lecture's 6 → 4 → 2 MLP on 1024 synthetic samples (two Gaussian clusters)",
        epochs=20,
        batch_size=32,
        lr=0.01,
        build_model=lambda splits: TinyMLP(splits.sample_shape[0], 4, splits.classes),
        load_data=lambda _: gaussian_clusters(1024, 6, 2),
    ),
    "deep-mlp": Workload(
        "deep-mlp",
        "8 × 1024 GELU MLP (8.4M parameters, CS336) with a 10-way head on 4096 synthetic samples",
        epochs=5,
        batch_size=64,
        lr=1e-3,
        build_model=lambda splits: DeepMLP(splits.sample_shape[0], 8, splits.classes),
        load_data=lambda _: gaussian_clusters(4096, 1024, 10, val_samples=1024, separation=6.0),
    ),
    "cnn": Workload(
        "cnn",
        "small CNN (2 conv + 2 FC) on the bundled 8×8 digits, or on MNIST with --data DIR",
        epochs=20,
        batch_size=64,
        lr=5e-3,
        build_model=lambda splits: SmallCNN(splits.sample_shape[-1], splits.sample_shape[0], splits.classes),
        load_data=_images,
        accepts_data_dir=True,
    ),
}
