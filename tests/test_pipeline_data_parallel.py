"""ZeRO × pipeline in bf16 against one process in bf16, step by step (the fp32 rows — dp2·pp2 through
the bucketed reducer, interleaved and zb under dp2, zero3·pp2 — are in test_gpt_layouts.py's matrix).

Both runs compute under the same autocast (bf16 matmuls over float32 weights, float32 gradients, ZeRO
shards and AdamW), so they differ only where bf16 rounds activations of another batch split (a pipeline
replica's micro-batches) and sums taken in another order (the reduce-scatter over dp). Measured on
gpt-tiny over 3 steps at lr 1e-3: |Δloss| 8e-5 and a weight RMS difference of 4e-5 against one bf16
process, where bf16 itself moves one process from fp32 by 4.5e-4 and 7.7e-5. The tolerances (2e-4,
6e-5) sit between the two — asserted, so the test can tell a layout's rounding from bf16's own; a
missed average or a wrong shard changes the update itself, not its rounding.
The largest single weight difference is not compared: Adam's first update moves a coordinate whose
gradient is nearly zero by ±lr whatever rounded it, so it reads ~2·lr for any two bf16 runs.
"""

from __future__ import annotations

import math
import os

import pytest

import meshwise
from meshwise.runtime.spawn import spawn
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.loop import GPTTrainer
from meshwise.train.gpt.resolve import resolve

STEPS = 3
LOSS_TOLERANCE = 2e-4
RMS_TOLERANCE = 6e-5
DTYPES = ("bf16", "fp32")


def _run(text: str, flags: dict) -> dict:
    settings = {
        "config": "gpt-tiny",
        "data": text,
        "seq_len": 32,
        "global_batch": 8,
        "steps": 20,
        "warmup": 1,
        "lr": 1e-3,
        "backend": "gloo",
    }
    config = GPTTrainConfig.from_flags(**(settings | flags))
    world = meshwise.init("gloo", timeout=90, mesh=config.mesh_shape(int(os.environ["WORLD_SIZE"])))
    try:
        trainer = GPTTrainer(world, resolve(config))
        losses = [trainer.train_step(step).loss for step in range(STEPS)]
        model = trainer.step_runner.sampling_model()  # collective
        held = next(model.parameters()).device.type != "meta"
        params = {n: p.detach().float().numpy().copy() for n, p in model.named_parameters()} if held else None
        return {"losses": losses, "params": params}
    finally:
        meshwise.shutdown()


def _worst(a: dict, b: dict) -> tuple[float, float, float]:
    """Largest |Δloss| over the steps, and the weights' largest and root-mean-square difference."""
    loss = max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True))
    diffs = [a["params"][n] - b["params"][n] for n in a["params"]]
    largest = max(float(abs(d).max()) for d in diffs)
    rms = math.sqrt(sum(float((d**2).sum()) for d in diffs) / sum(d.size for d in diffs))
    return loss, largest, rms


@pytest.fixture(scope="module")
def one_process(text: str) -> dict[str, dict]:
    """The one-process runs, in bf16 and in fp32 (each a single rank: a few seconds)."""
    runs = {dtype: spawn(_run, 1, args=(text, {"nproc": 1, "dtype": dtype}), timeout=110) for dtype in DTYPES}
    return {dtype: ranks[0] for dtype, ranks in runs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("zero", [2, 3])
def test_zero_pp2_in_bf16_trains_as_one_process_in_bf16(text: str, one_process: dict, zero: int) -> None:
    flags = {"nproc": 4, "zero": zero, "pp": 2, "dtype": "bf16"}
    layout = spawn(_run, 4, args=(text, flags), timeout=110)[0]
    loss, _, rms = _worst(layout, one_process["bf16"])
    assert loss < LOSS_TOLERANCE and rms < RMS_TOLERANCE, (loss, rms)
    # the tolerances can fail: bf16 itself moves one process away from fp32 by more
    bf16_loss, _, bf16_rms = _worst(one_process["bf16"], one_process["fp32"])
    assert bf16_loss > LOSS_TOLERANCE and bf16_rms > RMS_TOLERANCE, (bf16_loss, bf16_rms)
