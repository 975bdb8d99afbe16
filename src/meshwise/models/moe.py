"""Mixture of experts: a router sends each token to ``top_k`` of ``E`` expert MLPs and mixes their outputs.

This is the layer a GPT block uses in place of its MLP when ``GPTConfig.experts`` is set. It is written so
that expert parallelism needs no other copy of it:

- the routing (:func:`route`) and the two halves of the token shuffle (:func:`group_by_expert`,
  :func:`combine`) are plain functions of tensors, unit-testable without processes;
- the experts live in a ``ModuleDict`` keyed by their *global* index (``experts.5.fc.weight``), so a
  rank that holds experts 4–7 keeps the plain model's parameter names and a checkpoint reshards by name;
- the step between grouping and combining — running the experts on the grouped tokens — is the
  :attr:`MixtureOfExperts.exchange` hook. Here it runs every expert locally; expert parallelism
  (:mod:`meshwise.parallel.expert_parallel`) swaps in an all-to-all that sends each group to the rank
  holding its expert and brings the results back.

Routing follows Switch / GShard: router logits (a bias-free linear), softmax in float32, the ``top_k``
largest probabilities choose the experts and weight their outputs (not renormalised, so one expert at
probability p contributes p·expert(x), as in Switch). Dropless by default; with a capacity factor ``c`` an
expert takes at most ⌈c·T·k/E⌉ of the T·k assignments of one forward pass (one "group" in GShard's
terms: one rank's micro-batch), first choices before second choices and earlier tokens first; the rest
are dropped (that token's slot contributes nothing, the residual connection carries it) and counted.

The auxiliary losses are Switch's load-balancing loss E·Σₑ fₑ·Pₑ (fₑ the fraction of assignments routed
to e, Pₑ the mean router probability of e; 1 when perfectly balanced) and ST-MoE's router z-loss,
mean(logsumexp(logits)²). :func:`with_auxiliary_losses` adds them, weighted by their coefficients, to the
gradient of a loss without changing its value, so a training loop that prints the language-model loss
keeps printing exactly that. Where the loss cannot see the layer (a pipeline stage holds it, the loss is
on the last stage), :attr:`MixtureOfExperts.aux_gradient_scale` makes the layer add that gradient itself,
in its own backward, scaled as the loss is (1/micro-batches).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshwise.models.moe_shape import check_experts
from meshwise.parallel.protocols import Exchange, RunExperts


def expert_capacity(tokens: int, experts: int, top_k: int, capacity_factor: float | None) -> int | None:
    """Assignments one expert takes in a forward pass of ``tokens`` tokens: ⌈c·T·k/E⌉, None if dropless."""
    if capacity_factor is None:
        return None
    return math.ceil(capacity_factor * tokens * top_k / experts)


@dataclass(frozen=True)
class Routing:
    """Where the T tokens of one forward pass go: k assignments each."""

    experts: Tensor  # (T, k) int64: the chosen experts, best first
    weights: Tensor  # (T, k) float: their router probabilities (differentiable)
    kept: Tensor  # (T, k) bool: False where the expert was over capacity
    routed: Tensor  # (E,) int64: assignments each expert was chosen for (before the capacity)
    balance_loss: Tensor  # scalar: E·Σ f·P
    z_loss: Tensor  # scalar: mean logsumexp²

    @property
    def num_experts(self) -> int:
        return self.routed.numel()

    def kept_per_expert(self) -> Tensor:
        return torch.bincount(self.experts[self.kept], minlength=self.num_experts)


def route(logits: Tensor, top_k: int, capacity_factor: float | None = None) -> Routing:
    """Top-k routing of (T, E) router logits, with capacity dropping and the auxiliary losses."""
    tokens, experts = logits.shape
    logits = logits.float()  # softmax and logsumexp² in float32 even under bf16 autocast
    probs = logits.softmax(dim=-1)
    weights, chosen = probs.topk(top_k, dim=-1)
    routed = torch.bincount(chosen.reshape(-1), minlength=experts)
    kept = torch.ones_like(chosen, dtype=torch.bool)
    capacity = expert_capacity(tokens, experts, top_k, capacity_factor)
    if capacity is not None:
        # Priority: every token's first choice, then every second choice, ... (GShard), earlier tokens first.
        by_priority = chosen.t().reshape(-1)
        one_hot = F.one_hot(by_priority, experts)
        position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1  # place in its expert's queue
        kept = (position < capacity).reshape(top_k, tokens).t()
    fraction = routed.to(probs.dtype) / (tokens * top_k)
    balance = experts * (fraction * probs.mean(dim=0)).sum()
    z_loss = torch.logsumexp(logits, dim=-1).square().mean()
    return Routing(chosen, weights, kept, routed, balance, z_loss)


def group_by_expert(x: Tensor, routing: Routing) -> tuple[Tensor, Tensor, Tensor]:
    """The kept assignments' tokens sorted by expert (stable: token order within an expert).

    Returns (grouped (A, h), rows per expert (E,), ``order``: each row's index into the flattened
    (T·k) assignments, which :func:`combine` uses to send results back)."""
    flat_experts = routing.experts.reshape(-1)
    kept = routing.kept.reshape(-1).nonzero().squeeze(1)
    order = kept[torch.argsort(flat_experts[kept], stable=True)]
    counts = torch.bincount(flat_experts[order], minlength=routing.num_experts)
    top_k = routing.experts.shape[1]
    return x.index_select(0, order // top_k), counts, order


def combine(outputs: Tensor, order: Tensor, routing: Routing, tokens: int) -> Tensor:
    """Σₖ weightₖ·outputₖ per token: the experts' outputs (rows in :func:`group_by_expert`'s order)
    weighted by their router probabilities and added into their tokens' rows; dropped slots add 0."""
    top_k = routing.experts.shape[1]
    weights = routing.weights.reshape(-1)[order].to(outputs.dtype)
    mixed = outputs.new_zeros(tokens, outputs.shape[-1])
    return mixed.index_add(0, order // top_k, outputs * weights[:, None])


def run_here(grouped: Tensor, counts: Tensor, run: RunExperts) -> Tensor:
    """The one-process exchange: every expert is local, so the grouped tokens go straight to them."""
    return run(grouped, counts.tolist())


@dataclass
class RouterTally:
    """What a layer's router did since the last report: assignments chosen and kept per expert, and the
    auxiliary losses summed over its forward passes (in training mode only; evaluation is not counted).
    The sums stay on the router's device, so a step pays no host synchronisation for them."""

    routed: Tensor
    kept: Tensor
    balance_loss: Tensor
    z_loss: Tensor
    forwards: int = 0

    @classmethod
    def empty(cls, experts: int) -> RouterTally:
        counts, zero = torch.zeros(experts, dtype=torch.int64), torch.zeros((), dtype=torch.float64)
        return cls(counts, counts.clone(), zero, zero.clone())

    def add(self, routing: Routing) -> None:
        device = routing.routed.device
        self.routed = self.routed.to(device) + routing.routed
        self.kept = self.kept.to(device) + routing.kept_per_expert()
        self.balance_loss = self.balance_loss.to(device) + routing.balance_loss.detach()
        self.z_loss = self.z_loss.to(device) + routing.z_loss.detach()
        self.forwards += 1


class MixtureOfExperts(nn.Module):
    """``experts`` copies of an MLP (built by ``make_expert``) behind a top-k router; input (..., hidden).

    Expert parallelism sees it as an :class:`~meshwise.parallel.protocols.ExpertLayer`."""

    def __init__(
        self,
        hidden: int,
        experts: int,
        top_k: int,
        make_expert: Callable[[], nn.Module],
        *,
        capacity_factor: float | None = None,
        balance_coef: float = 0.0,
        z_loss_coef: float = 0.0,
    ) -> None:
        super().__init__()
        check_experts(experts, top_k, capacity_factor)
        self.num_experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.balance_coef, self.z_loss_coef = balance_coef, z_loss_coef
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleDict({str(e): make_expert() for e in range(experts)})
        self.exchange: Exchange = run_here
        self.routing: Routing | None = None  # the last forward's, for its auxiliary losses
        #: None: :func:`with_auxiliary_losses` adds the auxiliary losses at the loss; a number: this
        #: layer's backward adds their gradient, times it (a pipeline stage, whose loss is elsewhere)
        self.aux_gradient_scale: float | None = None
        self.tally = RouterTally.empty(experts)
        #: True while activation recomputation runs this forward again (set by the recomputed region):
        #: the tally and ``routing`` keep the first run's, so a step's routing is counted once and the
        #: auxiliary losses (already in the first run's graph) enter the gradient once
        self.recomputing = False

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        routing = route(self.router(flat), self.top_k, self.capacity_factor)
        grouped, counts, order = group_by_expert(flat, routing)
        outputs = self.exchange(grouped, counts, self.run_local_experts)
        mixed = combine(outputs, order, routing, flat.shape[0]).reshape(x.shape)
        if not self.recomputing:
            self.routing = routing
        if self.training:
            if not self.recomputing:
                self.tally.add(routing)
            if self.aux_gradient_scale is not None:
                aux = self.balance_coef * routing.balance_loss + self.z_loss_coef * routing.z_loss
                mixed = _WithAuxiliaryGradient.apply(mixed, aux, self.aux_gradient_scale)
        return mixed

    def run_local_experts(self, tokens: Tensor, rows: list[int]) -> Tensor:
        """Each expert this module holds (ascending global index) on its slice of ``tokens``."""
        pieces = tokens.split(rows)
        return torch.cat([expert(piece) for expert, piece in zip(self.experts.values(), pieces, strict=True)])

    def reset_tally(self) -> None:
        """Start counting afresh (after a report)."""
        self.tally = RouterTally.empty(self.num_experts)

    def auxiliary_loss(self) -> Tensor:
        """The last forward's coefficient-weighted load-balancing and z-losses."""
        if self.routing is None:
            raise RuntimeError("auxiliary_loss() needs a forward pass first")
        return self.balance_coef * self.routing.balance_loss + self.z_loss_coef * self.routing.z_loss


class _WithAuxiliaryGradient(torch.autograd.Function):
    """The layer's output unchanged; its backward also sends ``scale`` into the auxiliary loss's graph,
    which is the gradient of ``scale · aux`` added to the loss."""

    @staticmethod
    def forward(ctx: Any, output: Tensor, aux: Tensor, scale: float) -> Tensor:
        ctx.scale, ctx.aux_dtype = scale, aux.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


def moe_layers(model: nn.Module) -> list[MixtureOfExperts]:
    return [m for m in model.modules() if isinstance(m, MixtureOfExperts)]


def with_auxiliary_losses(loss: Tensor, model: nn.Module) -> Tensor:
    """``loss`` with the value it has and the gradient of loss + every MoE layer's weighted auxiliary loss
    (of its last forward): aux − aux.detach() is exactly 0, so the printed loss stays the model's own.
    A model without MoE layers gets ``loss`` back unchanged."""
    layers = [layer for layer in moe_layers(model) if layer.aux_gradient_scale is None]
    if not layers:
        return loss
    aux = torch.stack([layer.auxiliary_loss() for layer in layers]).sum()
    return loss + (aux - aux.detach()).to(loss.dtype)
