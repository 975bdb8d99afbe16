"""GPT model: published parameter counts on the meta device, FLOPs per token, shapes and validation."""

from __future__ import annotations

import pytest
import torch

from meshwise.models.gpt import CONFIGS, GPT, GPTConfig, gpt_config, language_model_loss

PUBLISHED = {"gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080,
             "gpt2-xl": 1_557_611_200}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parameter_count_on_meta_device(name: str) -> None:
    config = CONFIGS[name]
    with torch.device("meta"):
        model = GPT(config)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == config.num_parameters()
    assert all(p.device.type == "meta" for p in model.parameters())
    if name in PUBLISHED:
        assert counted == PUBLISHED[name]
    if name == "gpt-tiny":
        assert counted < 1_000_000
    if name == "gpt-nano":
        assert 9_000_000 < counted < 12_000_000


def test_flops_per_token_formula() -> None:
    c = CONFIGS["gpt2"]
    n = 124_439_808 - 1024 * 768
    assert c.flops_per_token() == 6 * n + 12 * 12 * 768 * 1024


def test_forward_shapes_tied_head_and_loss() -> None:
    torch.manual_seed(0)
    model = GPT(CONFIGS["gpt-tiny"])
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256)
    assert model.head.weight is model.wte.weight
    loss = language_model_loss(logits, torch.randint(0, 256, (2, 16)))
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5  # near-uniform at init
    # causal: changing a later token leaves earlier logits unchanged
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    assert torch.allclose(model(changed)[:, :10], logits[:, :10], atol=1e-6)


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown GPT config 'gpt5'"):
        gpt_config("gpt5")
    with pytest.raises(ValueError, match="not divisible by 5 heads"):
        gpt_config("gpt-tiny", heads=5)
    with pytest.raises(ValueError, match="longer than the position table"):
        GPT(GPTConfig(layers=1, hidden=8, heads=2, seq_len=4)).embed(torch.zeros(1, 5, dtype=torch.long))
    assert gpt_config("gpt-tiny", layers=2, hidden=None).layers == 2
