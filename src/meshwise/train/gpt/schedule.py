"""The learning-rate schedule: linear warmup, then a decay to a floor — a pure function of the step.

Shapes after warmup (``--lr-schedule``): ``cosine`` (GPT-2/3, nanoGPT), ``linear``, ``constant`` (no
decay), and ``wsd`` — warmup, stable, decay (MiniCPM, DeepSeek): the peak rate held until the last
:data:`WSD_DECAY_FRACTION` of the steps, then a linear decay to the floor, so a run can be extended
from any checkpoint of its stable phase.

Being a function of the step alone (no scheduler object) is what lets a resumed run continue on exactly
the same curve with nothing extra in the checkpoint, and lets tests check the curve without training.
"""

from __future__ import annotations

import math

#: the schedules ``--lr-schedule`` offers
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
#: the share of the steps a ``wsd`` schedule spends decaying (the MiniCPM paper's ~10–20 %)
WSD_DECAY_FRACTION = 0.2


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, steps: int, shape: str = "cosine") -> float:
    """Rate for 0-based ``step``: ``lr·(step+1)/warmup`` while warming up, then ``shape`` from ``lr`` at
    the end of warmup to ``min_lr`` at the last step (``constant`` stays at ``lr``)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if shape == "constant":
        return lr
    if shape == "wsd":
        decay_start = max(warmup, steps - max(1, round(WSD_DECAY_FRACTION * steps)))
        if step < decay_start:
            return lr
        warmup = decay_start - 1  # the decay below runs from the last stable step (at lr) to the end
    span = max(1, steps - 1 - warmup)
    progress = min(1.0, (step - warmup) / span)
    if shape in ("linear", "wsd"):
        return min_lr + (lr - min_lr) * (1.0 - progress)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
