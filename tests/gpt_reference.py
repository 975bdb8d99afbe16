"""The plain one-process GPT step the parity tests compare every layout against, written once.

Same seed, same global batch (the windows every rank's slices come from), the same AdamW, LR schedule and
global-norm clipping as the trainer, but no strategy at all: a GPT, ``loss.backward()``,
``clip_grad_norm_``, ``optimizer.step()``.
"""

from __future__ import annotations

import torch

from meshwise.data.windows import train_batch
from meshwise.models.gpt import GPT, language_model_loss
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.loop import GPTTrainer
from meshwise.train.gpt.schedule import lr_at


def reference_step(
    reference: GPT,
    optimizer: torch.optim.Optimizer,
    trainer: GPTTrainer,
    config: GPTTrainConfig,
    step: int,
    micro_batch: int | None = 2,
) -> tuple[float, float]:
    """Step ``step`` of the one-process run on the whole global batch, accumulated over micro-batches of
    ``micro_batch`` sequences (None: one pass); returns the mean micro-batch loss and the gradient norm."""
    lr = lr_at(step, lr=config.lr, min_lr=config.min_lr, warmup=config.warmup_steps, steps=config.steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad()
    inputs, targets = train_batch(trainer.splits, 32, config.global_batch, config.seed, step, 0, 1)
    size = micro_batch or len(inputs)
    micro = list(zip(inputs.split(size), targets.split(size), strict=True))
    losses = []
    for x, y in micro:
        loss = language_model_loss(reference(x), y)
        (loss / len(micro)).backward()
        losses.append(loss.item())
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), config.grad_clip)
    optimizer.step()
    return sum(losses) / len(losses), float(norm)
