"""torch's own implementation of each strategy, built the one way every meshwise benchmark compares against.

Shared by the per-strategy benchmarks and by ``bench_no_regression.py``, which times them against more
than one version of meshwise: so this module imports torch only, never meshwise, and works with any GPT
that has ``blocks`` of ``attn.{q,k,v,out}`` and ``mlp.{fc,proj}`` linears.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn


def megatron_plan(layers: int) -> dict[str, object]:
    """DTensor's Megatron plan for our GPT: q/k/v and fc column-wise, out and proj row-wise.

    The same six linears per layer meshwise splits; embeddings and head stay replicated (DTensor cannot
    shard a tied weight by rows in one plan)."""
    # imported here: a few seconds that only the ranks need
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, object] = {}
    for i in range(layers):
        for column in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[f"blocks.{i}.{column}"] = ColwiseParallel()
        for row in ("attn.out", "mlp.proj"):
            plan[f"blocks.{i}.{row}"] = RowwiseParallel()
    return plan


def dtensor_tensor_parallel(model: nn.Module, tp_mesh) -> nn.Module:
    """``parallelize_module`` with :func:`megatron_plan` over a 1-D DeviceMesh."""
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, tp_mesh, megatron_plan(len(model.blocks)))  # type: ignore[arg-type]


def fully_shard_blocks(model: nn.Module, dp_mesh) -> nn.Module:
    """FSDP2 as torchtitan applies it: ``fully_shard`` on every block, then on the root."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def language_model_stepper(
    model: nn.Module, optimizer: torch.optim.Optimizer, loss_of: Callable, tokens: torch.Tensor
) -> Callable[[], float]:
    """One training step on ``tokens`` (inputs and next-token targets), returning its loss."""
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> float:
        optimizer.zero_grad()
        loss = loss_of(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def pipeline_stepper(
    pipe, optimizer: torch.optim.Optimizer, tied: list[nn.Parameter], first: bool, x, y
) -> Callable[[], None]:
    """One step of torch's pipelining schedule ``pipe`` on this rank: the first stage feeds ``x``, the
    last scores ``y``; the tied copies' gradients are summed across the stages (torch's schedule leaves
    them apart; ours trains the same model) before the update."""

    def step() -> None:
        optimizer.zero_grad()
        if first:
            pipe.step(x)
        else:
            pipe.step(target=y, losses=[])
        for weight in tied:
            dist.all_reduce(weight.grad)
        optimizer.step()

    return step
