"""Full tensors from a tensor-parallel model's shards, for parity tests (training gathers any layout with
``state_dict.gather_plain``): each sharded tensor one all-gather over the group, padding removed."""

from __future__ import annotations

import torch
from torch import nn

from meshwise.comm.api import Communicator
from meshwise.parallel.tensor_parallel.layers import shard_dim
from meshwise.parallel.tensor_parallel.regions import gather_along
from meshwise.parallel.tensor_parallel.vocab import VocabParallelEmbedding


def full_tensors(model: nn.Module, comm: Communicator, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """``{name: full parameter}`` (or its full gradient with ``grads=True``; None gradients are skipped).
    Collective: every rank of ``comm`` calls it."""
    vocab_of = {id(m.weight): m.vocab for m in model.modules() if isinstance(m, VocabParallelEmbedding)}
    result = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            tensor = param.grad if grads else param
            if tensor is None:
                continue
            dim = shard_dim(param)
            if dim is None:
                result[name] = tensor.detach().clone()
                continue
            full = gather_along(tensor.detach(), comm, dim)
            result[name] = full.narrow(dim, 0, vocab_of.get(id(param), full.shape[dim])).clone()
    return result
