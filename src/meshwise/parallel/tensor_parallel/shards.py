"""Between full tensors and a tensor-parallel model's shards, in both directions.

What a one-process checkpoint, a parity test or an export needs: :func:`full_tensors` reassembles every
parameter (or gradient) under the original names, each sharded one with one all-gather over the group
(every rank calls it), vocabulary padding removed; :func:`gather_full` does it for one tensor shaped like
a parameter (e.g. an optimizer's moment) and :func:`local_shard` takes this rank's slice back out.
"""

from __future__ import annotations

import torch
from torch import nn

from meshwise.comm.api import Communicator
from meshwise.parallel.tensor_parallel.layers import shard_dim
from meshwise.parallel.tensor_parallel.regions import gather_along
from meshwise.parallel.tensor_parallel.vocab import VocabParallelEmbedding


def gather_full(
    tensor: torch.Tensor, param: nn.Parameter, comm: Communicator, shape: torch.Size
) -> torch.Tensor:
    """The full tensor of ``shape`` whose shard, laid out like ``param``, this rank holds in ``tensor``."""
    dim = shard_dim(param)
    if dim is None:
        return tensor.detach().clone()
    return gather_along(tensor.detach(), comm, dim).narrow(dim, 0, shape[dim]).clone()


def local_shard(full: torch.Tensor, param: nn.Parameter, comm: Communicator) -> torch.Tensor:
    """This rank's slice of ``full`` laid out like ``param`` (zero-padded as the vocabulary is)."""
    dim = shard_dim(param)
    if dim is None:
        return full
    padding = param.shape[dim] * comm.world_size - full.shape[dim]
    if padding:
        pad_shape = list(full.shape)
        pad_shape[dim] = padding
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    return full.chunk(comm.world_size, dim=dim)[comm.rank].clone()


def full_tensors(model: nn.Module, comm: Communicator, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """``{name: full parameter}`` (or its full gradient with ``grads=True``; None gradients are skipped)."""
    vocab_of = {id(m.weight): m.vocab for m in model.modules() if isinstance(m, VocabParallelEmbedding)}
    result = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            tensor = param.grad if grads else param
            if tensor is None:
                continue
            shape = list(param.shape)
            if shard_dim(param) is not None:
                shape[shard_dim(param)] *= comm.world_size
            if id(param) in vocab_of:
                shape[0] = vocab_of[id(param)]
            result[name] = gather_full(tensor, param, comm, torch.Size(shape))
    return result
