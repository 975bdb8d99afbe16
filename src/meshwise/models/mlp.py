"""The MLPs of the seeds: the DDP exercise's tiny 6 → 4 → 2 network and the lecture's deep GELU stack."""

from __future__ import annotations

import torch
from torch import nn


class TinyMLP(nn.Sequential):
    """6 → 4 → 2 with a ReLU: the exercise model, small enough that DDP shows mechanics, not speedup."""

    def __init__(self, features: int = 6, hidden: int = 4, outputs: int = 2) -> None:
        super().__init__(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, outputs))


class DeepMLP(nn.Module):
    """``layers`` bias-free d×d linear layers, each followed by GELU (the CS336 data-parallel example).

    With d = 1024 and 8 layers it holds 8·1024² ≈ 8.4M parameters in eight equal 4 MiB tensors: the
    benchmark model, where gradient communication is large enough to matter. ``classes`` adds a linear
    head so the stack can be trained on a classification task.
    """

    def __init__(self, dim: int = 1024, layers: int = 8, classes: int | None = None) -> None:
        super().__init__()
        if dim < 1 or layers < 1:
            raise ValueError(f"DeepMLP needs dim ≥ 1 and layers ≥ 1, got dim={dim}, layers={layers}")
        self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(layers))
        self.head = nn.Linear(dim, classes) if classes is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = nn.functional.gelu(layer(x))
        return self.head(x) if self.head is not None else x
