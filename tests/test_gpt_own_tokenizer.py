"""Fine-tune on one's own text (issue 30, Add): a text ``--data`` tokenized with a local tokenizer file —
made here, in the test, never downloaded — cached beside the text as ``.bin``, and ``--sample`` decoded
with it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from meshwise.cli import main
from meshwise.train.gpt import GPTTrainConfig
from meshwise.train.gpt.resolve import tokenizer_path

tokenizers = pytest.importorskip("tokenizers", reason="pip install -e '.[test]' installs tokenizers")

VOCAB = 300


@pytest.fixture(scope="module")
def tokenizer_json(text, tmp_path_factory) -> Path:
    """A byte-level BPE of 300 tokens trained on the test text: a GPT-2-style tokenizer in miniature."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([Path(text).read_text()], trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_text_is_tokenized_with_the_local_tokenizer_cached_and_sampled_with_it(
    text, tokenizer_json, tmp_path, capsys
):
    data = tmp_path / "mine.txt"
    data.write_text(Path(text).read_text())
    summary = tmp_path / "s.json"
    argv = [
        "train",
        "gpt",
        "--config",
        "gpt-tiny",
        "--vocab",
        str(VOCAB),
        "--seq-len",
        "32",
        "--global-batch",
        "4",
    ]
    argv += ["--eval-windows", "4", "--steps", "2", "--backend", "gloo", "--data", str(data)]
    assert main([*argv, "--tokenizer", str(tokenizer_json), "--sample", "12", "--json", str(summary)]) == 0
    (cache,) = tmp_path.glob("mine.txt.*.bin")
    expected = tokenizers.Tokenizer.from_file(str(tokenizer_json)).encode(data.read_text()).ids
    assert np.array_equal(np.fromfile(cache, dtype=np.uint16), np.asarray(expected, dtype=np.uint16))
    assert max(expected) >= 256  # merged tokens: not bytes
    result = json.loads(summary.read_text())
    assert result["dataset"] == cache.name
    assert result["sample"] and not re.fullmatch(r"[\d ]+", result["sample"])  # decoded text, not ids
    stamp = cache.stat().st_mtime_ns
    assert main([*argv, "--tokenizer", str(tokenizer_json.parent)]) == 0  # the folder works; cache reused
    assert cache.stat().st_mtime_ns == stamp


def test_an_init_from_folder_with_a_tokenizer_json_brings_it(tmp_path, tokenizer_json):
    (tmp_path / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())

    def found(init_from: Path) -> str | None:
        return tokenizer_path(GPTTrainConfig.from_flags(init_from=str(init_from)))

    assert found(tmp_path) == str(tmp_path)
    assert found(tmp_path / "model.safetensors") == str(tmp_path)
    (tmp_path / "bare").mkdir()
    assert found(tmp_path / "bare") is None
