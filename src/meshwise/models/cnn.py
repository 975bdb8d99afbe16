"""The seeds' small CNN (2 conv + 2 FC), sized from the image so it fits 8×8 digits and 28×28 MNIST."""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    """conv3×3 → ReLU → pool2, twice, then FC → ReLU → FC to ``classes`` logits.

    Padding keeps each convolution's size, so two poolings leave ``image_size // 4`` pixels a side: 2×2
    for the bundled 8×8 digits (about 14k parameters), 7×7 for MNIST.
    """

    def __init__(
        self, image_size: int = 8, channels: int = 1, classes: int = 10, width: int = 16, hidden: int = 64
    ) -> None:
        super().__init__()
        if image_size < 4:
            raise ValueError(f"SmallCNN pools twice by 2, so images must be at least 4×4, got {image_size}")
        side = image_size // 4
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(2 * width * side * side, hidden), nn.ReLU(), nn.Linear(hidden, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))
