"""Reassemble full parameters or gradients from a tensor-parallel model's shards.

What a one-process checkpoint, a parity test or an export needs: every rank of the group calls it (each
sharded tensor is one all-gather) and gets the full tensors under the original names, with the
vocabulary padding removed.
"""

from __future__ import annotations

import torch
from torch import nn

from meshwise.comm.api import Communicator
from meshwise.parallel.tensor_parallel.layers import shard_dim
from meshwise.parallel.tensor_parallel.regions import gather_along
from meshwise.parallel.tensor_parallel.vocab import VocabParallelEmbedding


def full_tensors(model: nn.Module, comm: Communicator, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """``{name: full parameter}`` (or its full gradient with ``grads=True``; None gradients are skipped)."""
    vocab_of = {id(m.weight): m.vocab for m in model.modules() if isinstance(m, VocabParallelEmbedding)}
    result = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            tensor = param.grad if grads else param
            if tensor is None:
                continue
            dim = shard_dim(param)
            if dim is not None:
                tensor = gather_along(tensor.detach(), comm, dim)
                if id(param) in vocab_of:
                    tensor = tensor[: vocab_of[id(param)]]
            result[name] = tensor.detach().clone()
    return result
