"""``meshwise train gpt --pp`` with ``--checkpoint``/``--resume`` and ``--sample``.

One spawn of 2 ranks runs every trainer of the checks on meshes built over the same communicator:
pp 2 and dp 2 (pp 1). A pipeline checkpoint resumes on a pipeline exactly (the same losses, bit for bit,
as the uninterrupted run), on other schedules and on data parallelism, and a data-parallel checkpoint
resumes on a pipeline, each within fp32 tolerance of the uninterrupted run (the micro-batch split, and so
the summation order, differs). Sampling from the gathered stages gives the same text as sampling from a
data-parallel model loaded from the same checkpoint, which is only possible if every weight arrived.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch.distributed.checkpoint as dcp

import meshwise
from meshwise.cli import main
from meshwise.comm.mesh import Mesh, MeshShape
from meshwise.models.gpt import CONFIGS, GPT
from meshwise.runtime.spawn import spawn
from meshwise.train.checkpoint_check import DamagedCheckpointError
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.loop import GPTTrainer
from meshwise.train.gpt.resolve import resolve
from test_gpt_pipeline_train import _tiny as tiny_run

STEPS, INTERRUPT = 6, 3


def _tiny(text: str, **overrides) -> GPTTrainConfig:
    """The pipeline loop test's tiny run, on 2 ranks, validated (and checkpointed) at the interruption."""
    small = {"global_batch": 4, "micro_batches": 2, "steps": STEPS, "eval_every": INTERRUPT, "nproc": 2}
    return tiny_run(text, **(small | overrides))


def _interrupted(world, config: GPTTrainConfig) -> None:
    """Train to the interruption, write the checkpoint, die."""
    trainer = GPTTrainer(world, resolve(config))
    for step in range(INTERRUPT):
        trainer.history.append(trainer.train_step(step))
    trainer.save_checkpoint(INTERRUPT)


def _rest(world, config: GPTTrainConfig, sample: int = 0) -> tuple[list[float], str | None, int]:
    """Resume ``config``'s checkpoint: the losses of the remaining steps, a sample taken right after
    loading (before any step), and the step it resumed at."""
    trainer = GPTTrainer(world, resolve(config.with_flags(resume=True)))
    text = trainer.sample(sample) if sample else None
    return [trainer.train_step(step).loss for step in range(INTERRUPT, STEPS)], text, trainer.first_step


def _checks(data: str, root: str) -> dict[str, object]:
    world = meshwise.init("gloo", timeout=60)
    try:
        dp_world = world  # init's default mesh: every rank on dp
        pp_world = replace(world, mesh=Mesh(world.comm, MeshShape(pp=2)))
        pp, dp = _tiny(data, pp=2), _tiny(data)
        straight = GPTTrainer(pp_world, resolve(pp))
        expected = [straight.train_step(step).loss for step in range(STEPS)]
        straight_dp = GPTTrainer(dp_world, resolve(dp))
        expected_dp = [straight_dp.train_step(step).loss for step in range(STEPS)]

        from_pp = pp.with_flags(checkpoint=f"{root}/pp")
        _interrupted(pp_world, from_pp)
        keys = sorted(GPTTrainer(pp_world, resolve(pp)).step_runner.state_dict()["model"])
        pp_rest, pp_text, first = _rest(pp_world, from_pp, sample=24)
        gpipe_rest, _, _ = _rest(pp_world, from_pp.with_flags(schedule="gpipe"))
        interleaved_rest, _, _ = _rest(pp_world, from_pp.with_flags(schedule="interleaved", virtual_stages=2))
        dp_rest, dp_text, _ = _rest(dp_world, dp.with_flags(checkpoint=f"{root}/pp"), sample=24)

        from_dp = dp.with_flags(checkpoint=f"{root}/dp")
        _interrupted(dp_world, from_dp)
        dp_to_pp_rest, _, _ = _rest(pp_world, pp.with_flags(checkpoint=f"{root}/dp"))
        return {
            "first step": first,
            "pp → pp exact": pp_rest == expected[INTERRUPT:],
            "pp, dp agree": max(abs(a - b) for a, b in zip(expected, expected_dp, strict=True)),
            "pp → gpipe": max(abs(a - b) for a, b in zip(gpipe_rest, expected[INTERRUPT:], strict=True)),
            "pp → interleaved": max(
                abs(a - b) for a, b in zip(interleaved_rest, expected[INTERRUPT:], strict=True)
            ),
            "pp → dp": max(abs(a - b) for a, b in zip(dp_rest, expected_dp[INTERRUPT:], strict=True)),
            "dp → pp": max(abs(a - b) for a, b in zip(dp_to_pp_rest, expected[INTERRUPT:], strict=True)),
            "same sample": pp_text == dp_text if world.is_main else pp_text is None and dp_text is None,
            "sample": pp_text,
            "keys": keys,
        }
    finally:
        meshwise.shutdown()


def test_pipeline_checkpoints_resume_on_any_layout_and_sample(text: str, tmp_path) -> None:
    first, second = spawn(_checks, 2, args=(text, str(tmp_path)), timeout=110)
    for result in (first, second):
        assert result["first step"] == INTERRUPT
        assert result["pp → pp exact"] is True
        assert result["same sample"] is True
        for key in ("pp, dp agree", "pp → gpipe", "pp → interleaved", "pp → dp", "dp → pp"):
            assert result[key] < 2e-5, (key, result[key])
    sample = first["sample"]
    assert isinstance(sample, str) and sample.startswith("\ndef ") and len(sample) > len("\ndef ")
    plain = set(GPT(CONFIGS["gpt-tiny"]).state_dict())
    stage0, stage1 = set(first["keys"]), set(second["keys"])
    # each stage holds its own blocks only; both hold the tied matrix, under its two plain names
    assert stage0 | stage1 == plain and stage0 & stage1 == {"wte.weight", "head.weight"}
    assert any(k.startswith("blocks.0.") for k in stage0) and not any(
        k.startswith("blocks.3.") for k in stage0
    )
    # the tied matrix is written once although two stages plan it
    storage = dcp.FileSystemReader(str(tmp_path / "pp" / "step-000003")).read_metadata().storage_data
    assert sum(index.fqn == "model.wte.weight" for index in storage) == 1
    optim = [index.fqn for index in storage if index.fqn.startswith("optim.state.")]
    assert len(optim) == len(set(optim)) and not any(".head.weight." in fqn for fqn in optim)
    assert json.loads((tmp_path / "pp" / "run.json").read_text())["step"] == INTERRUPT


def test_a_checkpoint_of_another_model_is_refused_and_left_alone(text: str, tmp_path, capsys) -> None:
    """The refusal happens before launch, and neither run.json nor the step directory changes."""
    directory = tmp_path / "ckpt"
    (directory / "step-000003").mkdir(parents=True)
    (directory / "step-000003" / ".metadata").write_bytes(b"written by a 2-layer run")
    run = {
        "format": "meshwise-gpt/1",
        "step": 3,
        "model": {"layers": 2, "hidden": 64, "heads": 4, "seq_len": 64, "vocab": 256, "dropout": 0.0},
        "run": {"global_batch": 4, "seed": 0, "train_seq_len": 16},
    }
    (directory / "run.json").write_text(json.dumps(run))
    before = {path: path.read_bytes() for path in directory.rglob("*") if path.is_file()}
    argv = ["train", "gpt", "--config", "gpt-tiny", "--data", text, "--seq-len", "16", "--global-batch", "4"]
    argv += [
        "-np",
        "2",
        "--pp",
        "2",
        "--micro-batches",
        "2",
        "--backend",
        "gloo",
        "--checkpoint",
        str(directory),
    ]
    assert main([*argv, "--resume"]) == 2
    assert "holds a run of GPTConfig(layers=2" in capsys.readouterr().err
    assert main(argv) == 2
    assert "already exists; pass --resume" in capsys.readouterr().err
    assert {path: path.read_bytes() for path in directory.rglob("*") if path.is_file()} == before
    with pytest.raises(DamagedCheckpointError, match=r"\.metadata is unreadable"):  # past the model check
        resolve(_tiny(text, pp=2, layers=2, checkpoint=str(directory), resume=True))
