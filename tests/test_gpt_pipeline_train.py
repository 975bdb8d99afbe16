"""``meshwise train gpt --pp``: the real training loop on a pipeline equals the one-process run; bad flags.

Both runs go through the whole loop (data order, learning-rate schedule, AdamW, gradient clipping,
validation), one on a single rank, one on 2 pipeline stages with the interleaved schedule (2 chunks per
rank): per-step training losses, gradient norms and validation losses must agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshwise.train.gpt import GPTTrainConfig, run_gpt_training
from meshwise.train.gpt.report import GPTResult
from meshwise.train.gpt.resolve import resolve


def _tiny(text: str, **overrides) -> GPTTrainConfig:
    settings = {
        "config": "gpt-tiny",
        "data": text,
        "seq_len": 16,
        "global_batch": 8,
        "micro_batches": 4,
        "steps": 4,
        "warmup": 1,
        "lr": 1e-3,
        "eval_every": 2,
        "eval_windows": 8,
        "backend": "gloo",
        "nproc": 1,
    }
    return GPTTrainConfig.from_flags(**(settings | overrides))


@pytest.fixture(scope="module")
def reference(text: str) -> GPTResult:
    result = run_gpt_training(_tiny(text))
    assert result is not None
    return result


def _assert_same_run(piped: GPTResult, reference: GPTResult) -> None:
    for ours, ref in zip(piped.history, reference.history, strict=True):
        assert ours.loss == pytest.approx(ref.loss, abs=1e-5), (ours, ref)
        assert ours.grad_norm == pytest.approx(ref.grad_norm, rel=1e-4), (ours, ref)
        assert (ours.val_loss is None) == (ref.val_loss is None)
        if ref.val_loss is not None:
            assert ours.val_loss == pytest.approx(ref.val_loss, abs=1e-5), (ours, ref)


def test_pipeline_training_matches_one_process(text: str, reference: GPTResult, tmp_path) -> None:
    trace, timeline = tmp_path / "pp.json", tmp_path / "pp.png"
    piped = run_gpt_training(
        _tiny(
            text,
            nproc=2,
            pp=2,
            schedule="interleaved",
            virtual_stages=2,
            trace=str(trace),
            timeline=str(timeline),
        )
    )
    assert piped is not None
    assert piped.mesh == "dp=1 tp=1 pp=2" and piped.parameters == reference.parameters
    _assert_same_run(piped, reference)
    assert trace.read_text().startswith('{"traceEvents"') and timeline.read_bytes()[:4] == b"\x89PNG"


def test_pipeline_times_data_parallel_checkpoints_and_samples(
    text: str, reference: GPTResult, tmp_path
) -> None:
    """pp 2 × dp 2 through the loop: the dp replicas plan the same checkpoint keys (written once), only
    replica 0 gathers its stages for --sample; a 2-rank data-parallel run resumes the checkpoint."""
    directory = tmp_path / "ckpt"
    piped = run_gpt_training(
        _tiny(text, nproc=4, pp=2, micro_batches=2, checkpoint=str(directory), sample=12)
    )
    assert piped is not None and piped.mesh == "dp=2 tp=1 pp=2"
    _assert_same_run(piped, reference)
    assert piped.sample is not None and piped.sample.startswith("\ndef ")
    assert piped.checkpoint == str(directory / "step-000004")
    resumed = run_gpt_training(
        _tiny(text, nproc=2, micro_batches=2, steps=5, checkpoint=str(directory), resume=True)
    )
    assert resumed is not None and resumed.first_step == 4
    assert [s.step for s in resumed.history] == [1, 2, 3, 4, 5]
    assert resumed.history[-1].loss < resumed.history[0].loss


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"nproc": 2, "pp": 2, "schedule": "pipedream"}, "unknown pipeline schedule 'pipedream'"),
        (
            {"nproc": 2, "pp": 2, "micro_batches": 2, "schedule": "interleaved", "virtual_stages": 4},
            "4 layers cannot be cut into 8 pipeline chunks",
        ),
        (
            {"nproc": 4, "pp": 4, "micro_batches": 2, "schedule": "interleaved"},
            "must be a multiple of --pp 4",
        ),
        ({"nproc": 2, "pp": 2, "micro_batch": 2}, "not both"),
        ({"micro_batches": 3}, "--micro-batches 3 does not divide the per-rank batch 8"),
        ({"schedule": "zb", "timeline": "x.png"}, "--schedule --timeline configure pipeline parallelism"),
    ],
)
def test_bad_pipeline_flags_are_refused_before_launch(text: str, overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve(_tiny(text, **overrides))


def test_pipeline_times_tensor_parallel_training_matches_one_process(text: str, reference: GPTResult) -> None:
    """``--pp 2 --tp 2 --sp`` on 4 ranks: the whole loop (AdamW, clipping over shards, validation with the
    vocabulary-parallel loss) equals the one-process run."""
    mixed = run_gpt_training(_tiny(text, nproc=4, pp=2, tp=2, sp=True, schedule="1f1b"))
    assert mixed is not None
    assert mixed.mesh == "dp=1 tp=2 pp=2" and mixed.parameters == reference.parameters
    _assert_same_run(mixed, reference)


def test_pipeline_times_tensor_parallel_checkpoints_samples_and_exports(text: str, tmp_path) -> None:
    """``--pp 2 --tp 2`` stages write their tp shards whole under the plain names: their checkpoint resumed
    in one process continues like a one-process checkpoint resumed on pp × tp, and --export-hf writes the
    one-process run's weights."""
    from safetensors.torch import load_file

    mixed_dir, plain_dir = tmp_path / "mixed", tmp_path / "plain"
    mixed = run_gpt_training(
        _tiny(
            text,
            nproc=4,
            pp=2,
            tp=2,
            sp=True,
            checkpoint=str(mixed_dir),
            sample=12,
            export_hf=str(tmp_path / "mixed_hf"),
        )
    )
    plain = run_gpt_training(_tiny(text, checkpoint=str(plain_dir), export_hf=str(tmp_path / "plain_hf")))
    assert mixed is not None and plain is not None
    assert mixed.sample is not None and len(mixed.sample) >= 12
    exported, expected = (
        load_file(tmp_path / "mixed_hf" / "model.safetensors"),
        load_file(tmp_path / "plain_hf" / "model.safetensors"),
    )
    assert exported.keys() == expected.keys()
    for key, tensor in expected.items():  # AdamW's 1/√v amplifies the shards' summation order: --tp alone
        assert torch.allclose(exported[key], tensor, atol=1e-4), key  # differs by 3.4e-5 here too

    def resumed(directory: Path, **overrides) -> list[float]:
        result = run_gpt_training(_tiny(text, steps=6, checkpoint=str(directory), resume=True, **overrides))
        assert result is not None and result.first_step == 4
        return [s.loss for s in result.history]

    # one process → pp × tp, and pp × tp → one process: the same two steps
    plain_on_mixed = resumed(plain_dir, nproc=4, pp=2, tp=2, sp=True)
    assert resumed(mixed_dir) == pytest.approx(plain_on_mixed, abs=1e-5)
