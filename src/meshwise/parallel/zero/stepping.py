"""The optimizer-step hooks that let any ``torch.optim`` optimizer train a sharded model.

Registered once, globally, when this package is imported: before an optimizer steps, every sharded
model whose master shards it holds gets to hand those shards their reduced gradients (and stage 1 to
reduce-scatter first); after the step, to push the updated shards to the compute copies. An optimizer
still holding a module's original parameters — built before ``shard()`` — is refused here, at its first
step, before it changes anything.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

OWNER = "_meshwise_zero_owner"  # on a master shard: (weakref to its ShardedModel, group index)
ORIGINAL = "_meshwise_zero_sharded"  # on a module parameter taken over by shard(): its name


def _sharded_groups(optimizer: torch.optim.Optimizer) -> list[tuple[Any, list[Any]]]:
    """The sharded models whose shards ``optimizer`` holds, each with those groups (in group order)."""
    found: dict[int, tuple[Any, set[int]]] = {}
    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            owner = getattr(param, OWNER, None)
            if owner is None:
                name = getattr(param, ORIGINAL, None)
                if name is not None:
                    raise RuntimeError(
                        f"{type(optimizer).__name__} holds the unsharded parameter {name!r} of a model that "
                        "was sharded: build the optimizer after shard(), on the sharded model's "
                        "parameters, e.g. torch.optim.AdamW(sharded.parameters(), ...)"
                    )
                continue
            model = owner[0]()
            if model is not None:
                found.setdefault(id(model), (model, set()))[1].add(owner[1])
    return [(model, [model.groups[i] for i in sorted(indices)]) for model, indices in found.values()]


def _pre_step(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    for model, groups in _sharded_groups(optimizer):
        model.before_step(groups)


def _post_step(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    for model, groups in _sharded_groups(optimizer):
        model.after_step(groups)


_HOOKS = (register_optimizer_step_pre_hook(_pre_step), register_optimizer_step_post_hook(_post_step))
