"""ZeRO stage 1 overlaps its reduce-scatters with backward, as stage 2 does, and keeps full gradients.

Each flat group is reduce-scattered from the gradient hooks as soon as its last gradient arrived, so the
communication runs while autograd is still computing earlier layers; stage 1 then differs from stage 2
only in what stays: its unsharded gradient buffers (zeroed once reduced) for the whole run, its reduced
shard until the step. Parity of the result with one process is tests/test_zero.py's matrix.
"""

from __future__ import annotations

import torch
from torch import nn

import meshwise
from meshwise.parallel.zero import shard
from meshwise.runtime.spawn import spawn


def _launches() -> dict[str, object]:
    world = meshwise.init("gloo", timeout=60)
    torch.manual_seed(0)
    layers = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))
    model = shard(layers, world.comm, stage=1, bucket_mb=1e-3, first_bucket_mb=1e-3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inside: list[bool] = []
    for group in model.groups:
        original = group.launch_reduce

        def launch(original=original) -> None:
            inside.append(torch._C._current_graph_task_id() != -1)  # -1: no backward is running
            original()

        group.launch_reduce = launch
    x = torch.randn(4, 16)
    with model.no_sync():
        model(x).square().mean().backward()
    found: dict[str, object] = {"groups": len(model.groups), "launched under no_sync": len(inside)}
    found["kept after no_sync"] = all(bool(g.flat_grad.abs().sum() > 0) for g in model.groups)
    model(x).square().mean().backward()
    found["in backward"] = inside
    found["reduced before the step"] = all(g.has_grad for g in model.groups)
    found["full buffers kept, zeroed"] = all(
        g.flat_grad is not None and not g.flat_grad.any() for g in model.groups
    )
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    found["stepped"] = all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    found["shard released"] = all(g.grad_shard is None for g in model.groups)
    meshwise.shutdown()
    return found


def test_stage1_reduce_scatters_from_gradient_hooks_during_backward() -> None:
    for result in spawn(_launches, 2, timeout=60):
        groups = result["groups"]
        assert groups >= 3, result  # several buckets, so launches can overlap what backward still does
        assert result["launched under no_sync"] == 0 and result["kept after no_sync"]
        assert result["in backward"] == [True] * groups, result
        assert result["reduced before the step"] and result["full buffers kept, zeroed"]
        assert result["stepped"] and result["shard released"]
