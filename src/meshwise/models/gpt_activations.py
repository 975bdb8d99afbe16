"""Activation memory of one transformer layer: the formula, and a measurement to check it against.

Megatron-LM (Korthikanti et al. 2022) counts the bytes a layer saves for backward as ``sbh(34 + 5as/h)``
for fp16 values and 1-byte dropout masks; tensor parallelism leaves ``10·sbh`` of it replicated
(``sbh(10 + 24/t + 5as/(ht))``), tensor + sequence parallelism divides all of it by ``t``. Our layer
saves the same tensors, so with ``v`` bytes per value and ``m`` per mask element the 34 splits into
16 values and 2 masks and the 5 into 2 values and 1 mask (docs/tensor_parallel.md):

    one rank:  sbh(16v + 2m) + as²b(2v + m)
    TP:        sbh(4v + 2m) + [sbh·12v + as²b(2v + m)] / t
    TP + SP:   [sbh(16v + 2m) + as²b(2v + m)] / t

:func:`~meshwise.models.gpt_shape.layer_activation_bytes` is the formula (torch-free, for the planner);
:func:`saved_activation_bytes` measures what autograd actually keeps, so the claim is checked rather than
assumed (benchmarks/bench_tensor.py and the tests).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from meshwise.comm.api import Communicator
from meshwise.models.gpt import GPT, GPTConfig
from meshwise.models.gpt_plan import tensor_parallel
from meshwise.models.gpt_shape import layer_activation_bytes
from meshwise.parallel.recompute.saved import saved_bytes


def saved_activation_bytes(module: nn.Module, *inputs: Any) -> int:
    """Bytes of the tensors ``module(*inputs)`` saves for backward: parameters excluded, each storage once
    (views of one tensor, such as the input q, k and v all read, cost its memory once)."""
    return saved_bytes(module, *inputs)


def dropout_mask_bytes() -> int:
    """Bytes per element of the mask dropout saves here (a float mask on CPU, bool on CUDA)."""
    x = torch.randn(1024, requires_grad=True)
    return saved_activation_bytes(nn.Dropout(0.1).train(), x) // 1024


def layer_activation_report(config: GPTConfig, comm: Communicator, batch: int) -> dict[str, dict[str, float]]:
    """Measured vs formula bytes of one layer in training mode: one process, TP and TP + SP over ``comm``.

    Every rank of ``comm`` must call it (the conversions are collective).
    """
    torch.manual_seed(0)
    full = GPT(config).train()
    mask = dropout_mask_bytes()
    t = comm.world_size
    rows = {}
    for name, tp, sp in (("one process", 1, False), ("tp", t, False), ("tp+sp", t, True)):
        model = full if tp == 1 else tensor_parallel(copy.deepcopy(full), comm, sequence_parallel=sp).train()
        x = torch.randn(batch, config.seq_len // (t if sp else 1), config.hidden, requires_grad=True)
        measured = saved_activation_bytes(model.blocks[0], x)
        formula = layer_activation_bytes(
            config, batch, tp=tp, sequence_parallel=sp, value_bytes=x.element_size(), mask_bytes=mask
        )
        rows[name] = {"measured": measured, "formula": formula, "ratio": measured / formula, "tp": tp}
    return rows
