"""Optimizer state made before the first step, for every strategy's ``state_dict`` (data parallel through
torch's ``get_state_dict``, ZeRO's flat shards, tensor-parallel slices): ``dcp.load`` fills only the
tensors it is given, and a run that has not stepped yet has none.
"""

from __future__ import annotations

import torch


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """A step at learning rate 0 on zero gradients, so a fresh run's state dict has the slots a checkpoint
    loads into; a no-op once every parameter has state."""
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
