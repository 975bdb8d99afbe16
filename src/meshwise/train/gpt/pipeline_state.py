"""``--pp`` checkpoints and ``--sample``: a pipeline stage's tensors under the plain GPT's names.

A stage's parameters are already named as in the plain model (``blocks.5.mlp.fc.weight``: see
:class:`~meshwise.train.gpt.pipeline_step.StageModule`), so its checkpoint state is the plain model's
state restricted to what the stage holds, in exactly the layout
:func:`torch.distributed.checkpoint.state_dict.get_state_dict` gives a data-parallel run:

- ``model``: every held tensor; the tied embedding/head matrix under both ``wte.weight`` and
  ``head.weight`` (one Parameter in the plain model);
- ``optim``: ``state`` — AdamW's slots per plain name, the tied matrix's under ``wte.weight`` — and
  ``param_groups`` naming the *whole* model's parameters, identical on every stage, so a pipeline
  checkpoint loads into a data-parallel run and the reverse.

The first and the last stage each hold an equal copy of the tied matrix (their gradients are summed, so
their AdamW states are equal too): both put it in their state under the same keys, and DCP, which
deduplicates a key planned by several ranks, writes it once. On load every stage reads only its own
keys; the last stage fills its head copy from the tied keys.

For ``--sample`` the stages' weights are gathered into a plain GPT on the first stage rather than
generation being run through the stages: generation is one sequence, one token at a time, so a pipeline
would keep only one stage busy at a time anyway, and a gathered model reuses ``GPT.generate`` unchanged.
The cost is one copy of the weights on that rank, once, at the end of the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from meshwise.comm.api import Communicator, ReduceOp
from meshwise.models.gpt import GPT, GPTConfig
from meshwise.parallel.expert_parallel import full_expert_state
from meshwise.parallel.tensor_parallel.shards import gather_full, local_shard

#: the plain model's keys of the tied embedding/head matrix; AdamW's state is under the first.
TIED = ("wte.weight", "head.weight")


def optimizer_key(stage_name: str) -> str:
    """The plain model's optimizer-state key of a stage parameter (the head copy is the tied matrix)."""
    return TIED[0] if stage_name in TIED else stage_name


def _slots(optimizer: torch.optim.Optimizer, param: nn.Parameter) -> dict[str, torch.Tensor]:
    """AdamW's state of ``param``; before the first step, zeros as slots a checkpoint loads into (AdamW's
    three: build_optimizer never turns on amsgrad)."""
    state = optimizer.state.get(param)
    if state:
        return dict(state)
    return {
        "step": torch.zeros((), dtype=torch.float32),
        "exp_avg": torch.zeros_like(param),
        "exp_avg_sq": torch.zeros_like(param),
    }


def group_names(shape_model: GPT, whole: torch.optim.Optimizer) -> list[list[str]]:
    """The plain model's parameter names of each optimizer group, as a data-parallel run's
    ``get_state_dict`` records them; ``whole`` is the run's optimizer built over the meta-device
    ``shape_model`` (it only supplies the grouping)."""
    names = {param: name for name, param in shape_model.named_parameters()}
    return [[names[p] for p in group["params"]] for group in whole.param_groups]


def _full_shapes(config: GPTConfig) -> dict[str, torch.Size]:
    """The plain model's tensor shapes by name, the tied matrix under both of its keys."""
    with torch.device("meta"):
        return {name: tensor.shape for name, tensor in GPT(config).state_dict().items()}


def stage_state_dict(
    stage: nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: list[list[str]],
    tp: Communicator | None = None,
    config: GPTConfig | None = None,
) -> dict[str, Any]:
    """``{"model": …, "optim": …}`` of this stage under the plain model's names (see the module docstring);
    ``groups`` from :func:`group_names`, the hyper-parameters (current learning rate included) this
    stage's own. With a tensor-parallel stage (``tp`` of more than one rank, and the model's ``config``)
    every shard — weights and AdamW moments — is gathered whole over ``tp`` first (a collective of the
    stage's tp ranks), so the checkpoint is the one a stage without tp writes; DCP writes each key once."""
    sharded = tp is not None and tp.world_size > 1
    shapes = _full_shapes(config) if sharded and config is not None else {}

    def whole(name: str, tensor: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
        if not sharded or tensor.dim() == 0:
            return tensor.detach()
        return gather_full(tensor, param, tp, shapes[name])

    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in stage.named_parameters():
        full = whole(name, param, param)
        for key in TIED if name in TIED else (name,):
            model[key] = full
        state[optimizer_key(name)] = {
            key: whole(name, value, param) for key, value in _slots(optimizer, param).items()
        }
    param_groups = [
        {**{k: v for k, v in mine.items() if k != "params"}, "params": names}
        for mine, names in zip(optimizer.param_groups, groups, strict=True)
    ]
    return {"model": model, "optim": {"state": state, "param_groups": param_groups}}


@torch.no_grad()
def load_stage_state_dict(
    stage: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], tp: Communicator | None = None
) -> None:
    """Copy a loaded :func:`stage_state_dict` into the stage's parameters and AdamW, each tensor-parallel
    rank taking its slice of the full tensors (the hyper-parameters stay the run's own: they come from its
    flags, and the learning rate from the schedule)."""
    sharded = tp is not None and tp.world_size > 1

    def mine(tensor: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
        return local_shard(tensor, param, tp) if sharded and tensor.dim() > 0 else tensor

    named = dict(stage.named_parameters())
    for name, param in named.items():
        param.copy_(mine(state["model"][name], param))
    index = {id(p): i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    slots = {
        index[id(param)]: {
            key: mine(value, param) for key, value in state["optim"]["state"][optimizer_key(name)].items()
        }
        for name, param in named.items()
    }
    optimizer.load_state_dict({"state": slots, "param_groups": optimizer.state_dict()["param_groups"]})


@torch.no_grad()
def gather_plain_model(
    stage: nn.Module,
    config: GPTConfig,
    pp: Communicator,
    device: torch.device,
    tp: Communicator | None = None,
    ep: Communicator | None = None,
    values: Mapping[str, torch.Tensor] | None = None,
) -> GPT | None:
    """Collective over ``pp`` (and ``tp``, ``ep`` when given): the plain GPT with every stage's weights, on
    pp rank 0 of ep rank 0 (None elsewhere). ``values``: what to gather in place of the stage's parameters,
    under their names — ZeRO's float32 masters when the stage computes with float16 copies (fp16), which
    would otherwise be sent as such.

    Who holds block i is agreed on with one all-reduce; the embeddings are on stage 0 (chunk 0 is always
    there), the final LayerNorm on the last. A tensor-parallel stage gathers its shards whole over ``tp``
    and a stage whose experts are spread over ``ep`` every expert over ``ep`` first; then one pipeline
    (ep rank 0's) sends: each owner its tensors in the plain model's order, stage 0 receiving them in that
    order, so the point-to-point messages always match.
    """
    owners = torch.zeros(config.layers, dtype=torch.int64)
    for index in stage.blocks:
        owners[int(index)] = pp.rank
    pp.all_reduce(owners, ReduceOp.SUM)
    params = dict(stage.named_parameters())
    values = params if values is None else values
    if tp is not None and tp.world_size > 1:  # each stage's tp shards whole first (collective over tp)
        shapes = _full_shapes(config)
        held = {name: gather_full(values[name], p, tp, shapes[name]) for name, p in params.items()}
    else:
        held = {name: values[name] for name in params}
    if ep is not None and ep.world_size > 1:  # every expert on every ep rank; ep rank 0's pipeline sends
        held |= full_expert_state(stage, ep)
        if ep.rank != 0:
            return None
    model = GPT(config).to(device) if pp.rank == 0 else None
    with torch.device("meta"):
        order = [(name, tuple(p.shape)) for name, p in GPT(config).named_parameters()]  # tied: wte only
    for name, shape in order:
        if name.startswith("blocks."):
            owner = int(owners[int(name.split(".")[1])])
        else:
            owner = pp.world_size - 1 if name.startswith("ln_f.") else 0
        if pp.rank == owner and owner != 0:
            pp.send(held[name].detach().contiguous(), 0)
        elif model is not None:
            target = model.get_parameter(name)
            if owner == 0:
                target.copy_(held[name])
            else:
                buffer = torch.empty(shape, dtype=target.dtype, device=device)
                pp.recv(buffer, owner)
                target.copy_(buffer)
    return model
