"""Optimizer state made before the first step, so a fresh run's state dict has slots a checkpoint loads into.

Every strategy's ``state_dict`` (data parallel through torch's ``get_state_dict``, ZeRO's flat shards,
tensor-parallel slices) names the optimizer's per-parameter state; a run that has not stepped yet has
none, and ``dcp.load`` fills only the tensors it is given. One rule for all of them lives here.
"""

from __future__ import annotations

import torch


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
