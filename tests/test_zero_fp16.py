"""float16 sharded training with dynamic loss scaling.

Parity: ``train gpt --zero 1|2|3 --dtype fp16`` on 2 ranks against a one-process reference that keeps a
float32 master model, computes with a float16 copy and steps through ``torch.amp.GradScaler`` (scale,
unscale, skip, update). Each rank runs one micro-batch of 2 sequences and the reference the same two
micro-batches of the global batch at loss/2; the float16 gradients are then the same numbers (halving is
exact in binary floating point, and a sum of two float16 values rounds once in both the reference's
accumulation and our float32-accumulating reduce-scatter): without clipping every step agrees to float32
rounding (measured: exactly). Clipping sums the squares of the shards in another order than torch does, a
1e-7 relative difference in the clip factor; that is enough to flip the float16 rounding of a few compute
weights (one float16 ulp is 5e-4 relative), which changes the next gradients at float16 precision, and
Adam, dividing by the gradient's own size, turns that into a fraction of one update on coordinates whose
gradient nearly cancels. So with clipping the bound is one Adam update, lr = 1e-3 (measured 1.1e-4).

Agreement: an inf planted in ONE rank's gradient shard skips the step on every rank and halves the scale
everywhere; the scale's growth and backoff follow GradScaler's own update kernel.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import meshwise
from meshwise.data.windows import train_batch
from meshwise.models.gpt import GPT, language_model_loss
from meshwise.parallel.zero import LossScaler, MixedPrecision, shard
from meshwise.runtime.spawn import spawn
from meshwise.train.gpt.loop import GPTTrainer
from meshwise.train.gpt.parallelize import build_optimizer
from meshwise.train.gpt.resolve import resolve
from test_gpt_zero import _tiny, text  # noqa: F401  (the module-scoped data fixture)

STEPS = 4


def _fp16_parity(data: str) -> dict[tuple[int, float], dict[str, float]]:
    world = meshwise.init("gloo", timeout=60)
    try:
        found = {}
        for stage, clip in ((1, 0.0), (2, 0.0), (3, 0.0), (3, 0.5)):
            config = _tiny(data, zero=stage, dtype="fp16", global_batch=4, micro_batch=None, grad_clip=clip)
            trainer = GPTTrainer(world, resolve(config))
            torch.manual_seed(config.data.seed)
            master = GPT(trainer.model_config)
            compute = GPT(trainer.model_config).half()
            optimizer = build_optimizer(master, config.optimizer)
            scaler = torch.amp.GradScaler("cpu")
            worst = {"loss": 0.0, "params": 0.0, "scale": 0.0}
            for step in range(STEPS):
                stats = trainer.train_step(step)
                for group in optimizer.param_groups:
                    group["lr"] = config.optimizer.lr_at(step)
                with torch.no_grad():
                    for p, q in zip(master.parameters(), compute.parameters(), strict=True):
                        q.copy_(p)
                inputs, targets = train_batch(trainer.splits, 32, 4, config.data.seed, step, 0, 1)
                losses, grads = [], []
                for x, y in zip(inputs.split(2), targets.split(2), strict=True):  # rank 0's, rank 1's
                    compute.zero_grad(set_to_none=True)
                    loss = language_model_loss(compute(x).float(), y)
                    scaler.scale(loss).backward()
                    losses.append(loss.item())
                    grads.append([q.grad.float() for q in compute.parameters()])
                for p, g0, g1 in zip(master.parameters(), *grads, strict=True):
                    p.grad = ((g0 + g1) / 2).half().float()  # the float16 mean, rounded once
                scaler.unscale_(optimizer)
                if clip:
                    torch.nn.utils.clip_grad_norm_(master.parameters(), clip)
                scaler.step(optimizer)
                scaler.update()
                worst["loss"] = max(worst["loss"], abs(stats.loss - sum(losses) / 2))
                ours = trainer.step_runner.full_model()
                pairs = zip(ours.parameters(), master.parameters(), strict=True)
                worst["params"] = max(worst["params"], *((p - q).abs().max().item() for p, q in pairs))
                difference = abs(trainer.step_runner.scaler.scale - scaler.get_scale())
                worst["scale"] = max(worst["scale"], difference)
            worst["dtype"] = str(trainer.step_runner.model.groups[0].full.dtype)
            found[(stage, clip)] = worst
        return found
    finally:
        meshwise.shutdown()


def test_fp16_zero_matches_a_one_process_grad_scaler_run(text: str) -> None:  # noqa: F811
    for result in spawn(_fp16_parity, 2, args=(text,), timeout=110):
        for (stage, clip), worst in result.items():
            assert worst["dtype"] == "torch.float16", stage
            assert worst["scale"] == 0.0, (stage, worst)
            if not clip:  # the same float16 numbers, the same float32 arithmetic
                assert worst["loss"] < 1e-6 and worst["params"] < 1e-6, (stage, worst)
            else:  # clipping's norm is summed in another order: see the module docstring
                assert worst["loss"] < 1e-4 and worst["params"] < 1e-3, (stage, worst)


# ---------------------------------------------------------------------------------------------- agreement
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 3))


def _inject_inf_on_one_rank() -> dict[int, dict[str, object]]:
    """Per stage: a clean step, then a step whose gradient holds an inf on rank 1 only, then a clean one."""
    comm = meshwise.init("gloo", timeout=60).comm
    results = {}
    for stage in (1, 2, 3):
        model = shard(_mlp(), comm, stage=stage, mixed_precision="fp16")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = LossScaler(comm, init_scale=1024.0)
        history = []
        for step in range(3):
            generator = torch.Generator().manual_seed(step * 10 + comm.rank)
            x, y = torch.randn(4, 7, generator=generator), torch.randn(4, 3, generator=generator)
            scaler.scale_loss(nn.functional.mse_loss(model(x), y)).backward()
            if step == 1 and comm.rank == 1:
                model.groups[-1].grad_shard[0] = math.inf  # reduced in backward: rank 1's shard only
            before = torch.cat([t.reshape(-1) for t in model.state_dict().values()])
            found = scaler.unscale_(model)
            model.clip_grad_norm_(1.0)
            scaler.update(found)
            optimizer.step()
            optimizer.zero_grad()
            after = torch.cat([t.reshape(-1) for t in model.state_dict().values()])
            steps = {float(s["step"]) for s in optimizer.state.values()}
            history.append((found, scaler.scale, bool(torch.equal(before, after)), steps))
        results[stage] = {"history": history, "skipped": scaler.skipped}
    meshwise.shutdown()
    return results


def test_an_inf_on_one_rank_skips_the_step_on_every_rank_and_lowers_the_scale() -> None:
    for result in spawn(_inject_inf_on_one_rank, 2, timeout=60):
        for stage, seen in result.items():
            assert seen["history"] == [
                (False, 1024.0, False, {1.0}),
                (True, 512.0, True, {1.0}),  # skipped: nothing moved, AdamW's step count did not advance
                (False, 512.0, False, {2.0}),
            ], stage
            assert seen["skipped"] == 1


@pytest.mark.parametrize("interval", [1, 3])
def test_scale_updates_follow_grad_scalers_kernel(interval: int) -> None:
    overflows = [False, False, True, False, False, False, True, True, False, False, False, False]
    ours = LossScaler(comm=None, init_scale=256.0, growth_interval=interval)  # type: ignore[arg-type]
    scale, tracker = torch.tensor([256.0]), torch.tensor([0], dtype=torch.int32)
    for overflow in overflows:
        ours.update(overflow)
        torch._amp_update_scale_(scale, tracker, torch.tensor([float(overflow)]), 2.0, 0.5, interval)
        assert (ours.scale, ours.growth_tracker) == (scale.item(), tracker.item())


def test_fp16_compute_is_accepted_and_bad_scaler_settings_are_refused() -> None:
    assert MixedPrecision.parse("fp16").needs_loss_scaling
    assert not MixedPrecision.parse("bf16").needs_loss_scaling
    with pytest.raises(ValueError, match="growth_factor > 1"):
        LossScaler(comm=None, growth_factor=1.0)  # type: ignore[arg-type]
