"""``meshwise train gpt --zero 1|2|3``: parity with one process, resume across layouts, bad input, CLI.

Parity follows tests/test_gpt_train.py: every rank runs the real trainer (gradient accumulation, clipping,
AdamW with decay and no-decay groups) on its dp slice and, beside it, a one-process reference built from
plain pieces (the whole global batch, the same micro-batches, ``build_optimizer``'s AdamW, torch's
clipping) is compared after every step. The tolerance is that test's, 1e-5 at lr 1e-3 (about 1 % of one
Adam update; see its docstring): ZeRO reduces in a different order than one process sums, nothing else.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch.distributed.tensor import DTensor

import meshwise
from gpt_reference import reference_step
from meshwise.cli import main
from meshwise.models.gpt import GPT
from meshwise.runtime.spawn import spawn
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.loop import GPTTrainer
from meshwise.train.gpt.parallelize import build_optimizer
from meshwise.train.gpt.resolve import resolve
from test_gpt_train import _tiny as _dp_tiny
from test_gpt_train import text  # noqa: F401  (the module-scoped data fixture)

STEPS = 4
TOLERANCE = 1e-5


def _tiny(text: str, **overrides) -> GPTTrainConfig:  # noqa: F811
    """The dp parity test's run, with a smaller batch and clipping that acts on these steps."""
    return _dp_tiny(text, **({"global_batch": 8, "grad_clip": 0.5, "eval_windows": 4} | overrides))


def _parity(data: str) -> dict[int, dict[str, float]]:
    """Stages 1, 2, 3 on this job's ranks, each against its own fresh reference."""
    world = meshwise.init("gloo", timeout=60)
    try:
        found = {}
        for stage in (1, 2, 3):
            config = _tiny(data, zero=stage)
            trainer = GPTTrainer(world, resolve(config))
            torch.manual_seed(config.data.seed)
            reference = GPT(trainer.model_config)
            optimizer = build_optimizer(reference, config.optimizer)
            worst = {"loss": 0.0, "params": 0.0, "norm": 0.0}
            for step in range(STEPS):
                stats = trainer.train_step(step)
                expected, norm = reference_step(reference, optimizer, trainer, config, step)
                worst["loss"] = max(worst["loss"], abs(stats.loss - expected))
                worst["norm"] = max(worst["norm"], abs(stats.grad_norm - norm) / norm)
                worst["clipped"] = worst.get("clipped", False) or norm > config.optimizer.grad_clip
                ours = trainer.step_runner.full_model()
                pairs = zip(ours.parameters(), reference.parameters(), strict=True)
                worst["params"] = max(worst["params"], *((p - q).abs().max().item() for p, q in pairs))
            worst["accumulation"] = config.accumulation(trainer.dp)
            worst["groups"] = [len(g["params"]) > 0 for g in trainer.step_runner.optimizer.param_groups]
            found[stage] = worst
        return found
    finally:
        meshwise.shutdown()


def test_every_zero_stage_matches_one_process_step_by_step(text: str) -> None:  # noqa: F811
    for result in spawn(_parity, 2, args=(text,), timeout=110):
        for stage, worst in result.items():
            assert worst["accumulation"] == 2 and worst["groups"] == [True, True], stage
            assert worst["clipped"] and worst["norm"] < 1e-5, (stage, worst)
            assert worst["loss"] < TOLERANCE, (stage, worst)
            assert worst["params"] < TOLERANCE, (stage, worst)


# ---------------------------------------------------------------------------------------------- resume
RESUME = {"steps": 6, "global_batch": 4, "micro_batch": None}


def _train(trainer: GPTTrainer, steps: range) -> list[float]:
    return [trainer.train_step(step).loss for step in steps]


def _flat(trainer: GPTTrainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer.step_runner.full_model().parameters()])


def _save_then_resume_on_two(data: str, root: str) -> dict[str, object]:
    """ZeRO-3 and plain dp each write a checkpoint after 3 steps; ZeRO-1 and dp resume the ZeRO-3 one."""
    world = meshwise.init("gloo", timeout=60)
    try:
        straight = GPTTrainer(world, resolve(_tiny(data, zero=3, **RESUME)))
        expected = _train(straight, range(6))
        for name, zero in (("zero3", 3), ("dp", 0)):
            writer = GPTTrainer(world, resolve(_tiny(data, zero=zero, checkpoint=f"{root}/{name}", **RESUME)))
            writer.history = [writer.train_step(step) for step in range(3)]
            writer.save_checkpoint(3)
            if zero == 3:
                found_local = _local_elements(writer.step_runner.state_dict())
                shards = 3 * sum(group.layout.shard_numel for group in writer.step_runner.model.groups)
        found: dict[str, object] = {"expected": expected, "local": found_local, "shards": shards}
        bf16 = GPTTrainer(world, resolve(_tiny(data, zero=3, dtype="bf16", **RESUME)))
        found["bf16 losses"] = _train(bf16, range(3))
        found["bf16 compute"] = {str(g.full.dtype) for g in bf16.step_runner.model.groups}
        for zero in (3, 1, 0):
            config = _tiny(data, zero=zero, checkpoint=f"{root}/zero3", resume=True, **RESUME)
            resumed = GPTTrainer(world, resolve(config))
            found[f"zero{zero} from zero3"] = (resumed.first_step, _train(resumed, range(3, 6)))
            found[f"zero{zero} params"] = (_flat(resumed) - _flat(straight)).abs().max().item()
        return found
    finally:
        meshwise.shutdown()


def _local_elements(state: dict) -> dict[str, tuple[int, int]]:
    """For each model / AdamW tensor handed to DCP: (this rank's elements of it, the tensor's elements)
    — what a rank materialises while saving."""
    tensors = {f"model.{k}": v for k, v in state["model"].items() if isinstance(v, DTensor)}
    for name, slots in state["optim"]["state"].items():
        tensors |= {f"optim.{name}.{k}": v for k, v in slots.items() if isinstance(v, DTensor)}
    unique = {id(t): (key, t) for key, t in reversed(tensors.items())}.values()  # a tied weight once
    local = {key: t.to_local().local_shards() for key, t in unique}
    return {key: (sum(s.numel() for s in local[key]), t.size().numel()) for key, t in unique}


def _resume_on_one(data: str, root: str) -> dict[str, object]:
    """N → M: both 2-rank checkpoints continue as ZeRO-2 on one rank."""
    world = meshwise.init("gloo", timeout=60)
    try:
        found: dict[str, object] = {}
        for name in ("zero3", "dp"):
            config = _tiny(data, zero=2, checkpoint=f"{root}/{name}", resume=True, **RESUME)
            resumed = GPTTrainer(world, resolve(config))
            found[f"zero2 from {name}"] = (resumed.first_step, _train(resumed, range(3, 6)))
        return found
    finally:
        meshwise.shutdown()


def _close(pair: object, expected: list[float]) -> bool:
    first, losses = pair  # type: ignore[misc]
    return first == 3 and all(abs(a - b) < TOLERANCE for a, b in zip(losses, expected[3:], strict=True))


def test_a_zero3_checkpoint_resumes_as_zero1_as_dp_and_on_another_world_size(text: str, tmp_path) -> None:  # noqa: F811
    root = str(tmp_path / "ckpt")
    both = spawn(_save_then_resume_on_two, 2, args=(text, root), timeout=110)
    two = both[0]
    expected = two["expected"]
    assert _close(two["zero3 from zero3"], expected), two
    assert two["zero3 params"] < TOLERANCE, two
    # saving: every parameter and moment is a DTensor; the ranks' local pieces cover each exactly
    # (none twice, padding never), so each rank hands DCP about half of all elements, not all of them
    local = [found["local"] for found in both]
    assert {k.split(".")[0] for k in local[0]} == {"model", "optim"} and len(local[0]) > 10, local
    assert local[0].keys() == local[1].keys()
    for key, (held, total) in local[0].items():
        assert held + local[1][key][0] == total, (key, held, local[1][key], total)
    everything = sum(total for _, total in local[0].values())
    for rank in local:  # at most its master shards and two moments' worth; about 1/N of everything
        held = sum(held for held, _ in rank.values())
        assert held <= two["shards"] and abs(held - everything / 2) < 0.02 * everything, (held, everything)
    assert _close(two["zero1 from zero3"], expected), two
    assert _close(two["zero0 from zero3"], expected), two
    assert two["zero1 params"] < TOLERANCE and two["zero0 params"] < TOLERANCE, two
    # bf16 compute copies of fp32 master shards: close to fp32 (rounding only), not equal
    assert two["bf16 compute"] == {"torch.bfloat16"}
    assert all(abs(a - b) < 0.05 for a, b in zip(two["bf16 losses"], expected, strict=False)), two
    one = spawn(_resume_on_one, 1, args=(text, root), timeout=110)[0]
    assert _close(one["zero2 from zero3"], expected), (one, expected)
    assert _close(one["zero2 from dp"], expected), (one, expected)


# ---------------------------------------------------------------------------------------------- command line
@pytest.mark.timeout(200)  # two 2-rank CLI runs (peak measurement, eval, sample) on busy cores
def test_the_command_line_trains_fp16_zero3_prints_memory_and_resumes_as_zero1(text: str, tmp_path, capsys):  # noqa: F811
    argv = ["train", "gpt", "-np", "2", "--config", "gpt-tiny", "--data", text, "--seq-len", "32"]
    argv += ["--global-batch", "4", "--eval-every", "2", "--eval-windows", "4", "--backend", "gloo"]
    argv += ["--checkpoint", str(tmp_path / "ckpt")]
    assert main([*argv, "--steps", "2", "--zero", "3", "--dtype", "fp16", "--sample", "8"]) == 0
    out = capsys.readouterr().out
    assert "Memory (ZeRO-3, per rank, accounted vs formula)" in out, out
    lines = {line.split(":")[0].strip(): line.split(":")[1].split("(total")[0] for line in out.splitlines()
             if line.strip().startswith(("rank ", "formula:"))}  # fmt: skip
    assert lines["rank 0"] == lines["rank 1"] == lines["formula"], lines  # accounted = the ZeRO formula
    scale, skipped = re.search(r"Loss scale += (\d+) \(fp16; (\d+) steps? skipped", out).groups()
    assert int(scale) == 2**16 // 2 ** int(skipped)  # each overflow halved it; 2 steps cannot grow it
    assert "----- sample -----" in out
    assert main([*argv, "--steps", "4", "--zero", "1", "--resume", "--json", str(tmp_path / "r.json")]) == 0
    assert "Memory (ZeRO-1" in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["first_step"] == 2


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"dtype": "fp16"}, r"--dtype fp16 needs loss scaling, .* with --zero 1\|2\|3: add --zero"),
    ],
)
def test_zero_bad_input_is_one_clear_error_before_any_rank_starts(text: str, overrides, match) -> None:  # noqa: F811
    with pytest.raises(ValueError, match=match):
        resolve(_tiny(text, **overrides))


def test_zero_on_one_rank_and_fp16_with_zero_are_valid(text: str) -> None:  # noqa: F811
    resolve(_tiny(text, zero=2, nproc=1))
    resolve(_tiny(text, zero=1, dtype="fp16", nproc=2))
    resolve(_tiny(text, zero=3, tp=2, sp=True, nproc=4))  # ZeRO over tensor-parallel shards
    resolve(_tiny(text, zero=2, pp=2, nproc=4))  # ZeRO-2 on each pipeline stage
    resolve(_tiny(text, zero=3, pp=2, nproc=4, dtype="bf16"))  # ZeRO-3 × pp, in bf16
    resolve(_tiny(text, zero=1, pp=2, nproc=2, dtype="fp16"))  # fp16 × pp: loss scaled on the last stage
