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
from meshwise.train.gpt.resolve import resolve


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
    lr = config.optimizer.lr_at(step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad()
    inputs, targets = train_batch(trainer.splits, 32, config.data.global_batch, config.data.seed, step, 0, 1)
    size = micro_batch or len(inputs)
    micro = list(zip(inputs.split(size), targets.split(size), strict=True))
    losses = []
    for x, y in micro:
        loss = language_model_loss(reference(x), y)
        (loss / len(micro)).backward()
        losses.append(loss.item())
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), config.optimizer.grad_clip)
    optimizer.step()
    return sum(losses) / len(losses), float(norm)


#: the resume tests: a run of RESUME_STEPS steps on layout A checkpoints after RESUME_AT; layout B resumes
RESUME_AT, RESUME_STEPS = 2, 4


def resume_run(config: GPTTrainConfig) -> dict:
    """On a spawned rank: ``config``'s run to RESUME_STEPS (from its checkpoint when ``config.output.resume``,
    saving one after RESUME_AT otherwise); its losses by step, the plain model's parameters (None on a
    rank that holds no gathered model), the rank's training tokens by step (``batches``: the data position
    a resume continues from) and the note a resume printed about its random streams."""
    import os

    import meshwise

    world = meshwise.init("gloo", timeout=90, mesh=config.mesh_shape(int(os.environ["WORLD_SIZE"])))
    try:
        trainer = GPTTrainer(world, resolve(config))
        batches, read = {}, trainer.micro_batches

        def recorded(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            batches[step] = torch.cat([x for x, _ in read(step)]).tolist()
            return read(step)

        trainer.micro_batches = recorded  # type: ignore[method-assign]
        losses = {}
        for step in range(trainer.first_step, RESUME_STEPS):
            losses[step] = trainer.train_step(step).loss
            if step + 1 == RESUME_AT and not config.output.resume:
                trainer.save_checkpoint(RESUME_AT)
        model = trainer.step_runner.sampling_model()
        held = next(model.parameters()).device.type != "meta"
        params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()} if held else None
        return {"losses": losses, "params": params, "batches": batches, "note": trainer.random_note}
    finally:
        meshwise.shutdown()


def assert_resumed(a: dict, b: dict, loss_tolerance: float, param_tolerance: float) -> None:
    """Layout B's steps after the checkpoint, and its final weights, equal layout A's uninterrupted run."""
    import pytest

    for step in range(RESUME_AT, RESUME_STEPS):
        assert b["losses"][step] == pytest.approx(a["losses"][step], abs=loss_tolerance), step
    assert set(b["params"]) == set(a["params"])
    for name, value in a["params"].items():
        assert abs(b["params"][name] - value).max() < param_tolerance, name
