"""``--pp --sample``: a pipeline's stages gathered into a plain GPT.

For ``--sample`` the stages' weights are gathered into a plain GPT on the first stage rather than
generation being run through the stages: generation is one sequence, one token at a time, so a pipeline
would keep only one stage busy at a time anyway, and a gathered model reuses ``GPT.generate`` unchanged.
The cost is one copy of the weights on that rank, once, at the end of the run. (Checkpoints need no
gathering: every stage writes its own pieces through the seam's one writer.)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from meshwise.comm.api import Communicator, ReduceOp
from meshwise.models.gpt import GPT, GPTConfig
from meshwise.parallel.expert_parallel import full_expert_state
from meshwise.parallel.tensor_parallel.shards import gather_full


def _full_shapes(config: GPTConfig) -> dict[str, torch.Size]:
    """The plain model's tensor shapes by name, the tied matrix under both of its keys."""
    with torch.device("meta"):
        return {name: tensor.shape for name, tensor in GPT(config).state_dict().items()}


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
