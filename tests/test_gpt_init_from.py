"""``meshwise train gpt --init-from`` / ``--export-hf``: fine-tuning Hugging Face GPT-2 weights on 2 ranks.

The checkpoint is a tiny ``GPT2LMHeadModel`` with random weights saved by ``transformers`` itself, so the
test holds our loader to the real format. The first step's loss must be the Hugging Face model's loss on
the same global batch (the run really started from those weights, on every rank), and the exported
folder must load back into ``GPT2LMHeadModel`` with the run's final validation loss.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from meshwise.cli import main
from meshwise.data.windows import train_batch, val_batches
from meshwise.models.gpt import language_model_loss
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.resolve import resolve

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install -e '.[test]' installs it)",
)

SEQ, BATCH, WINDOWS = 32, 4, 8


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A random 2-layer GPT-2 over bytes, saved as ``transformers`` saves it (model.safetensors + config)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(3)
    config = GPT2Config(
        vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    directory = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    GPT2LMHeadModel(config).save_pretrained(directory, safe_serialization=True)
    return directory


def _hf_losses(directory: Path, text: str) -> tuple[float, float]:
    """The Hugging Face model's loss on the run's first global batch and on its validation windows."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(directory).eval()
    splits = resolve(GPTTrainConfig.from_flags(data=text, seq_len=SEQ)).load_data()
    x, y = train_batch(splits, SEQ, BATCH, 0, 0, 0, 1)
    total = count = 0.0
    with torch.no_grad():
        first = language_model_loss(model(x).logits, y).item()
        for inputs, targets in val_batches(splits, SEQ, WINDOWS, BATCH, 0, 1):
            logits = model(inputs).logits
            total += torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), targets.flatten(), reduction="sum"
            )
            count += targets.numel()
    return first, float(total / count)


def _argv(text: str, init: Path, report: Path, *extra: str) -> list[str]:
    return [
        "train", "gpt", "-np", "2", "--init-from", str(init), "--data", text, "--seq-len", str(SEQ),
        "--global-batch", str(BATCH), "--steps", "2", "--warmup", "0", "--eval-every", "2",
        "--eval-windows", str(WINDOWS), "--backend", "gloo", "--json", str(report), *extra,
    ]  # fmt: skip


def test_data_parallel_fine_tune_starts_from_the_weights_exports_them_and_resume_wins(
    text: str, hf_dir: Path, tmp_path: Path
) -> None:
    report, exported, ckpt = tmp_path / "run.json", tmp_path / "export", tmp_path / "ckpt"
    argv = _argv(text, hf_dir, report, "--export-hf", str(exported), "--checkpoint", str(ckpt))
    assert main(argv) == 0
    data = json.loads(report.read_text())
    start_loss, _ = _hf_losses(hf_dir, text)
    assert data["model"] == f"GPT-2 from {hf_dir}"
    assert data["parameters"] == 2 * (12 * 32**2 + 13 * 32) + (256 + 64) * 32 + 2 * 32  # blocks, tables, ln_f
    assert data["history"][0]["loss"] == pytest.approx(start_loss, abs=1e-5)
    assert data["exported"] == str(exported / "model.safetensors")
    _, exported_val = _hf_losses(exported, text)
    assert exported_val == pytest.approx(data["final_val_loss"], abs=1e-5)
    assert exported_val != pytest.approx(data["initial_val_loss"], abs=1e-4)  # it did train
    assert json.loads((exported / "config.json").read_text())["n_layer"] == 2

    # --resume wins over --init-from: weights full of NaN next to the same config are never read
    poisoned = tmp_path / "nan"
    poisoned.mkdir()
    (poisoned / "config.json").write_text((hf_dir / "config.json").read_text())
    from safetensors.torch import load_file, save_file

    weights = {
        k: torch.full_like(v, float("nan")) for k, v in load_file(hf_dir / "model.safetensors").items()
    }
    save_file(weights, str(poisoned / "model.safetensors"))
    resumed = _argv(text, poisoned, report, "--checkpoint", str(ckpt), "--resume")
    resumed[resumed.index("--steps") + 1] = "3"
    assert main(resumed) == 0
    history = json.loads(report.read_text())["history"]
    assert [s["step"] for s in history] == [1, 2, 3] and torch.isfinite(torch.tensor(history[2]["loss"]))


@pytest.mark.parametrize(
    ("flags", "mesh"),
    [(("--tp", "2"), "dp=1 tp=2 pp=1"), (("--pp", "2", "--micro-batches", "2"), "dp=1 tp=1 pp=2")],
    ids=["tp", "pp"],
)
def test_model_parallel_fine_tune_starts_from_the_weights_and_exports_them_whole(
    text: str, hf_dir: Path, tmp_path: Path, flags: tuple[str, ...], mesh: str
) -> None:
    report, exported = tmp_path / "run.json", tmp_path / "export"
    assert main(_argv(text, hf_dir / "model.safetensors", report, *flags, "--export-hf", str(exported))) == 0
    data = json.loads(report.read_text())
    assert data["mesh"] == mesh
    assert data["history"][0]["loss"] == pytest.approx(_hf_losses(hf_dir, text)[0], abs=1e-5)
    assert _hf_losses(exported, text)[1] == pytest.approx(data["final_val_loss"], abs=1e-5)


def test_bad_init_and_export_settings_are_one_clear_error_before_any_rank_starts(
    text: str, hf_dir: Path, tmp_path: Path
) -> None:
    bare = tmp_path / "bare"  # weights without config.json: the heads are unknown
    bare.mkdir()
    (bare / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes())
    liar = tmp_path / "liar"  # a config.json that does not describe the weights
    liar.mkdir()
    (liar / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes())
    (liar / "config.json").write_text(
        json.dumps(json.loads((hf_dir / "config.json").read_text()) | {"n_layer": 3})
    )
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    cases = [
        ({"init_from": str(tmp_path / "missing")}, r"--init-from: GPT-2 weights .*missing do not exist"),
        ({"init_from": str(tmp_path)}, "holds neither model.safetensors nor pytorch_model.bin"),
        ({"config": "gpt-tiny"}, r"holds a GPT-2 with layers 2, .* but --config gpt-tiny asks for layers 4"),
        ({"layers": 3}, r"but --layers 3 disagrees: drop --layers 3"),
        ({"init_from": str(bare)}, r"no config\.json beside the weights .* pass --heads N"),
        ({"init_from": str(liar)}, "config.json says layers 3, .* the files do not belong together"),
        ({"init_from": str(bare), "heads": 5}, "not divisible by 5 heads"),
        ({"export_hf": str(a_file)}, "--export-hf .*file.txt is a file; name a folder"),
    ]
    base = {"init_from": str(hf_dir), "data": text, "seq_len": SEQ, "global_batch": BATCH, "backend": "gloo"}
    for overrides, match in cases:
        with pytest.raises((ValueError, FileNotFoundError), match=match):
            resolve(GPTTrainConfig.from_flags(**(base | overrides)))
    # what is accepted: the heads given by flag without config.json, a matching --config, a missing folder
    assert (
        resolve(GPTTrainConfig.from_flags(**(base | {"init_from": str(bare), "heads": 4}))).model_config.heads
        == 4
    )
    assert resolve(
        GPTTrainConfig.from_flags(**(base | {"heads": 4, "export_hf": str(tmp_path / "new" / "dir")}))
    )
