"""Hugging Face GPT-2 interop: the mapping (always) and logits against ``transformers`` (when installed)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from meshwise.models.gpt import GPT, GPTConfig
from meshwise.models.gpt_hf import (
    config_from_state_dict,
    from_hf_state_dict,
    load_hf_gpt2,
    save_hf_gpt2,
    to_hf_state_dict,
)

CONFIG = GPTConfig(layers=2, hidden=32, heads=4, seq_len=16, vocab=50)
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
NO_TRANSFORMERS = "transformers is not installed (pip install -e '.[test]' installs it)"


def _ours() -> GPT:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    with torch.no_grad():  # non-trivial LayerNorms and biases, so a mixed-up mapping cannot pass
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def test_mapping_round_trips_and_splits_c_attn_by_columns() -> None:
    model = _ours()
    hf = to_hf_state_dict(model)
    c_attn = hf["transformer.h.1.attn.c_attn.weight"]
    assert c_attn.shape == (32, 96)  # Conv1D: (in, out)
    assert torch.equal(c_attn[:, 32:64], model.blocks[1].attn.k.weight.t())
    assert torch.equal(hf["lm_head.weight"], model.wte.weight)
    assert config_from_state_dict(hf, heads=4) == CONFIG
    back = from_hf_state_dict(hf, CONFIG)
    mine = {k: v for k, v in model.state_dict().items() if k != "head.weight"}
    assert back.keys() == mine.keys() and all(torch.equal(back[k], mine[k]) for k in mine)


def test_save_and_load_gives_the_same_logits(tmp_path) -> None:
    model = _ours()
    save_hf_gpt2(model, tmp_path)
    loaded = load_hf_gpt2(tmp_path).eval()
    assert loaded.head.weight is loaded.wte.weight
    tokens = torch.randint(0, 50, (2, 16))
    assert torch.equal(loaded(tokens), model(tokens))


def test_bad_weights_are_named(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors nor pytorch_model\.bin"):
        load_hf_gpt2(tmp_path)
    torch.save({"x": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_hf_gpt2(tmp_path)
    with pytest.raises(ValueError, match="not a GPT-2 state dict"):
        load_hf_gpt2(tmp_path, heads=4)


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason=NO_TRANSFORMERS)
@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pytorch_model.bin"])
def test_transformers_gpt2_loads_with_equal_logits_and_round_trips(tmp_path, safe: bool) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    hf_config = GPT2Config(
        vocab_size=50,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    reference = GPT2LMHeadModel(hf_config).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    reference.save_pretrained(tmp_path / "hf", safe_serialization=safe)
    ours = load_hf_gpt2(tmp_path / "hf").eval()
    tokens = torch.randint(0, 50, (3, 16))
    with torch.no_grad():
        expected = reference(tokens).logits
    torch.testing.assert_close(ours(tokens), expected, rtol=1e-5, atol=1e-5)
    save_hf_gpt2(ours, tmp_path / "back")
    reloaded = GPT2LMHeadModel.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, expected, rtol=1e-5, atol=1e-5)
