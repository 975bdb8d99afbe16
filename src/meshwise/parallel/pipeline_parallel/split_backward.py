"""Backward split into B (input gradient) and W (weight gradient) for zero-bubble schedules.

Asking autograd for the gradient of a chunk's input and of every ``nn.Linear`` *output* walks the graph
once and skips each Linear's weight matmul (no weight is requested): that is B, what the previous stage
waits for. W is then ``weight.grad += gᵀ·x`` and ``bias.grad += Σg`` per Linear, from its input saved at
forward and the output gradient B left, so no graph is walked twice. Other parameters (LayerNorms,
embeddings, a head tied to an embedding) are cheap and get their gradients in B. Both passes add
gradients through autograd (a backward from the leaves), not by writing ``.grad``, so post-accumulate
hooks fire as in an ordinary backward: that is how data parallelism's bucketed reducer and ZeRO's
gradient sync learn that a gradient is in. The price: a micro-batch's Linear inputs and output gradients
live until its W runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LinearRecord:
    """One Linear's part of what a (chunk, micro-batch)'s forward and B leave for its W."""

    module: nn.Linear
    input: torch.Tensor
    output: torch.Tensor
    grad: torch.Tensor | None = None


SplitRecord = list[LinearRecord]  # a (chunk, micro-batch)'s Linears, in forward order


class SplitBackward:
    """Records the Linear inputs of forwards and runs B and W for the chunks of one rank."""

    def __init__(self, chunks: Sequence[nn.Module]) -> None:
        shared = {
            id(p)
            for c in chunks
            for m in c.modules()
            if not isinstance(m, nn.Linear)
            for p in m.parameters(recurse=False)
        }
        self._linears = [
            m for c in chunks for m in c.modules() if isinstance(m, nn.Linear) and id(m.weight) not in shared
        ]
        managed = {id(p) for m in self._linears for p in m.parameters()}
        self._others = {id(c): [p for p in c.parameters() if id(p) not in managed] for c in chunks}
        self._recording: SplitRecord | None = None
        self._handles = [m.register_forward_hook(self._hook) for m in self._linears]

    def _hook(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if self._recording is not None and torch.is_grad_enabled():
            self._recording.append(LinearRecord(module, inputs[0].detach(), output))  # type: ignore[arg-type]

    def forward(self, chunk: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, SplitRecord]:
        record: SplitRecord = []
        self._recording = record
        try:
            return chunk(x), record
        finally:
            self._recording = None

    def backward_input(
        self,
        chunk: nn.Module,
        record: SplitRecord,
        output: torch.Tensor,
        grad: torch.Tensor | None,
        inputs: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """B: the gradient of ``inputs`` (None for the first chunk); keeps Linear output grads for W."""
        others = self._others[id(chunk)]
        wanted = ([inputs] if inputs is not None else []) + [r.output for r in record] + others
        grads = torch.autograd.grad(output, wanted, grad_outputs=grad, allow_unused=True)
        offset = 1 if inputs is not None else 0
        for rec, g in zip(record, grads[offset:], strict=False):
            rec.grad, rec.output = g, None  # type: ignore[assignment]  # drop the graph, keep the gradient
        _accumulate(others, grads[offset + len(record) :])
        return grads[0] if inputs is not None else None

    @staticmethod
    def backward_weight(record: SplitRecord) -> None:
        """W: weight and bias gradients of every Linear from its saved input and output gradient."""
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        for rec in record:
            if rec.grad is None:
                continue
            g = rec.grad.reshape(-1, rec.grad.shape[-1])
            params.append(rec.module.weight)
            grads.append(g.t() @ rec.input.reshape(-1, rec.input.shape[-1]))
            if rec.module.bias is not None:
                params.append(rec.module.bias)
                grads.append(g.sum(0))
        record.clear()
        _accumulate(params, grads)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _accumulate(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """Add ``grads`` into ``params``' ``.grad`` as autograd does (their hooks fire); None: no gradient."""
    pairs = [(p, g.detach().to(p.dtype)) for p, g in zip(params, grads, strict=True) if g is not None]
    if pairs:
        torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])
