"""The GPT run's AdamW, one rule for every layout: which parameters decay, the groups, and state made
before the first step so a checkpoint has slots to load into."""

from __future__ import annotations

import torch
from torch import nn

from meshwise.train.gpt.config import GPTTrainConfig


def decays(_name: str, param: nn.Parameter) -> bool:
    """AdamW's weight decay applies to matrices and embeddings (≥ 2 dims), not to biases and LayerNorm
    gains (decaying those only pulls them from their useful values): the one rule every step uses."""
    return param.dim() >= 2


def adamw(decayed: list[nn.Parameter], rest: list[nn.Parameter], config: GPTTrainConfig) -> torch.optim.AdamW:
    """AdamW as GPT-2 is trained — by default betas (0.9, 0.95) (--beta1/--beta2/--eps), decay on
    ``decayed`` only — over any parameters (whole ones, tensor-parallel shards, or ZeRO's flat master
    shards of one kind)."""
    groups = [{"params": decayed, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps)


def build_optimizer(model: nn.Module, config: GPTTrainConfig) -> torch.optim.AdamW:
    """:func:`adamw` over ``model``'s trainable parameters, grouped by :func:`decays`."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return adamw([p for n, p in named if decays(n, p)], [p for n, p in named if not decays(n, p)], config)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state before the first step (a step at learning rate 0 on zero gradients),
    so a fresh run's state dict has the slots a checkpoint loads into — as torch's ``get_state_dict`` does
    for the data-parallel path. A no-op once every parameter has state."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(p in optimizer.state for p in params):
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
