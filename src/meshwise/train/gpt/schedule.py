"""The learning-rate schedule: linear warmup, then cosine decay to a floor — a pure function of the step.

Being a function of the step alone (no scheduler object) is what lets a resumed run continue on exactly
the same curve with nothing extra in the checkpoint, and lets tests check the curve without training.
"""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, steps: int) -> float:
    """Rate for 0-based ``step``: ``lr·(step+1)/warmup`` while warming up, then cosine from ``lr`` at the
    end of warmup to ``min_lr`` at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, steps - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
