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


def build_optimizer(model: nn.Module, config: OptimizerSection) -> torch.optim.AdamW:
    """AdamW as GPT-2 is trained — by default betas (0.9, 0.95) (--beta1/--beta2/--eps), decay by
    :func:`decays` only — over ``model``'s trainable parameters (whole ones or tensor-parallel shards), or
    over a ZeRO model's float32 master shards (its flat groups never mix the two kinds, so each shard
    belongs to one optimizer group)."""
    if isinstance(model, ShardedModel):
        decayed, rest = model.parameters_where(decays), model.parameters_where(lambda n, p: not decays(n, p))
    else:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        decayed, rest = [p for n, p in named if decays(n, p)], [p for n, p in named if not decays(n, p)]
    groups = [{"params": decayed, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps)
