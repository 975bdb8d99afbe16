"""The GPT run's AdamW, one rule for every layout: which parameters decay, and the groups (the state made
before the first step is :mod:`meshwise.parallel.optimizer_state`'s)."""

from __future__ import annotations

import torch
from torch import nn

from meshwise.parallel.zero.sharded import ShardedModel
from meshwise.train.gpt.sections import OptimizerSection


def decays(_name: str, param: nn.Parameter) -> bool:
    """AdamW's weight decay applies to matrices and embeddings (≥ 2 dims), not to biases and LayerNorm
    gains (decaying those only pulls them from their useful values): the one rule every step uses."""
    return param.dim() >= 2


def adamw(
    decayed: list[nn.Parameter], rest: list[nn.Parameter], config: OptimizerSection
) -> torch.optim.AdamW:
    """AdamW as GPT-2 is trained — by default betas (0.9, 0.95) (--beta1/--beta2/--eps), decay on
    ``decayed`` only — over any parameters (whole ones, tensor-parallel shards, or ZeRO's flat master
    shards of one kind)."""
    groups = [{"params": decayed, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps)


def build_optimizer(model: nn.Module, config: OptimizerSection) -> torch.optim.AdamW:
    """:func:`adamw` over ``model``'s trainable parameters, grouped by :func:`decays`."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return adamw([p for n, p in named if decays(n, p)], [p for n, p in named if not decays(n, p)], config)


def sharded_adamw(zero: nn.Module, config: OptimizerSection) -> torch.optim.AdamW:
    """:func:`adamw` over ZeRO's float32 master shards, grouped by :func:`decays` (its flat groups never
    mix the two kinds, so each shard belongs to one optimizer group)."""
    assert isinstance(zero, ShardedModel)
    rest = zero.parameters_where(lambda n, p: not decays(n, p))
    return adamw(zero.parameters_where(decays), rest, config)
