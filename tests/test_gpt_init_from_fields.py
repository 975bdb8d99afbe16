"""``--init-from`` never loads weights into a different function than the checkpoint's (issue 30.4): each
config.json field that changes what GPT-2 computes is refused by name, another model type is named, a
vocabulary that is not the data's gets a note, and the exported config.json carries bos/eos ids."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from gpt_cli import one_line, refuse_ranks
from meshwise.cli import main

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="transformers is not installed (pip install -e '.[test]' installs it)",
)


def _hf(directory: Path, vocab: int = 256) -> Path:
    """A random 2-layer GPT-2 saved by ``transformers`` itself."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    GPT2LMHeadModel(config).save_pretrained(directory, safe_serialization=True)
    return directory


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return _hf(tmp_path_factory.mktemp("hf") / "tiny")


def _init_argv(text: str, directory: Path, *extra: str) -> list[str]:
    argv = ["train", "gpt", "--data", text, "--seq-len", "32", "--global-batch", "4", "--eval-windows", "4"]
    return [*argv, "--backend", "gloo", "--init-from", str(directory), *extra]


FIELDS = {
    "activation_function": ("relu", "activation_function 'relu'"),
    "layer_norm_epsilon": (1e-6, "layer_norm_epsilon 1e-06"),
    "scale_attn_weights": (False, "scale_attn_weights False"),
    "scale_attn_by_inverse_layer_idx": (True, "scale_attn_by_inverse_layer_idx True"),
    "reorder_and_upcast_attn": (True, "reorder_and_upcast_attn True"),
    "n_inner": (64, "n_inner 64 (ours: 4·n_embd = 128)"),
    "tie_word_embeddings": (False, "tie_word_embeddings False"),
}


def _edited(source: Path, target: Path, **fields) -> Path:
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    config = json.loads((target / "config.json").read_text()) | fields
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("field", list(FIELDS))
def test_a_field_that_changes_the_function_is_refused_by_name(
    text, hf_dir, tmp_path, capsys, monkeypatch, field
):
    refuse_ranks(monkeypatch)
    value, named = FIELDS[field]
    directory = _edited(hf_dir, tmp_path / "edited", **{field: value})
    assert main(_init_argv(text, directory)) == 2
    assert named in one_line(capsys.readouterr().err)


def test_every_such_field_is_named_in_the_one_line(text, hf_dir, tmp_path, capsys, monkeypatch):
    refuse_ranks(monkeypatch)
    directory = _edited(hf_dir, tmp_path / "edited", activation_function="silu", n_inner=100)
    assert main(_init_argv(text, directory)) == 2
    err = one_line(capsys.readouterr().err)
    assert "activation_function 'silu'" in err and "n_inner 100" in err


def test_another_model_type_is_named(text, hf_dir, tmp_path, capsys, monkeypatch):
    refuse_ranks(monkeypatch)
    directory = _edited(hf_dir, tmp_path / "edited", model_type="llama")
    assert main(_init_argv(text, directory)) == 2
    assert "'llama' model, not GPT-2" in one_line(capsys.readouterr().err)


def test_a_vocabulary_other_than_the_datas_gets_a_note_and_the_export_names_bos_eos(text, tmp_path, capsys):
    directory = _hf(tmp_path / "wide", vocab=300)
    export = tmp_path / "out"
    assert main(_init_argv(text, directory, "--steps", "2", "--export-hf", str(export))) == 0
    assert (
        "note: --init-from's vocabulary has 300 tokens, but --data is read as bytes"
        in capsys.readouterr().out
    )
    config = json.loads((export / "config.json").read_text())
    assert config["bos_token_id"] is None and config["eos_token_id"] is None  # no <|endoftext|> in 300


def test_a_gpt2_vocabulary_exports_its_end_of_text_as_bos_and_eos(tmp_path):
    from meshwise.models.gpt import GPT, GPTConfig
    from meshwise.models.gpt_hf import save_hf_gpt2

    model = GPT(GPTConfig(layers=1, hidden=8, heads=2, seq_len=8, vocab=50257))
    config = json.loads((save_hf_gpt2(model, tmp_path).parent / "config.json").read_text())
    assert config["bos_token_id"] == config["eos_token_id"] == 50256
