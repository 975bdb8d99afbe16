"""``--tp`` checkpoints and ``--sample`` of the data-parallel step: a tensor-parallel shard's tensors
under the plain GPT's names.

Checkpoints hold full tensors under the plain model's names, model and AdamW state alike (gathered from
the shards, vocabulary padding removed, the tied head under both of its keys), so a tp checkpoint has the
layout of a data-parallel one and each rank takes its slices back on load — AdamW's slots by name, so a
checkpoint of any layout loads. ``full_model`` reassembles a plain GPT: it is collective over ``mesh.tp``,
so every rank calls it.
"""

from __future__ import annotations

from typing import Any

import torch

from meshwise.comm.api import Communicator
from meshwise.models.gpt import GPT
from meshwise.models.gpt_plan import gpt_plan
from meshwise.parallel.optimizer_state import init_optimizer_state
from meshwise.parallel.tensor_parallel import full_tensors
from meshwise.parallel.tensor_parallel.shards import gather_full, local_shard


@torch.no_grad()
def full_model(local: GPT, tp: Communicator) -> GPT:
    """The plain GPT reassembled from this rank's tensor-parallel shard (collective over ``tp``)."""
    full = GPT(local.config).to(next(local.parameters()).device)
    full.load_state_dict(full_tensors(local, tp), strict=False)  # the tied head is wte
    return full


def tensor_parallel_state_dict(
    local: GPT, optimizer: torch.optim.Optimizer, tp: Communicator
) -> dict[str, Any]:
    """Model and AdamW state as full tensors under the plain model's names (collective over ``tp``)."""
    init_optimizer_state(optimizer)
    names = {param: name for name, param in local.named_parameters()}
    model = full_tensors(local, tp)
    state = {
        names[param]: {
            key: gather_full(value, param, tp, model[names[param]].shape)
            if isinstance(value, torch.Tensor) and value.shape == param.shape
            else value
            for key, value in entry.items()
        }
        for param, entry in optimizer.state.items()
    }
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [names[p] for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]
    for first, copy in gpt_plan(local.config).tied:  # the plain model's state names both keys
        model.setdefault(copy, model[first])
    return {"model": model, "optim": {"state": state, "param_groups": groups}}


@torch.no_grad()
def load_tensor_parallel_state_dict(
    local: GPT, optimizer: torch.optim.Optimizer, state: dict[str, Any], tp: Communicator
) -> None:
    """Each rank takes its slices of a loaded :func:`tensor_parallel_state_dict` (of any layout)."""
    named = dict(local.named_parameters())
    for name, param in named.items():
        param.copy_(local_shard(state["model"][name], param, tp))
    # AdamW's slots by name, into this optimizer's own order (a checkpoint of another layout — ZeRO's
    # groups, say — lists its parameters in another one); the hyper-parameters stay this run's
    names = {id(param): name for name, param in named.items()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    slots = {
        i: {
            key: local_shard(value, named[name], tp)
            if isinstance(value, torch.Tensor) and value.dim() > 0
            else value
            for key, value in state["optim"]["state"][name].items()
        }
        for i, name in enumerate(order)
    }
    optimizer.load_state_dict({"state": slots, "param_groups": optimizer.state_dict()["param_groups"]})
