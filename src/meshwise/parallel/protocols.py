"""What the strategies need of a model's own modules: small structural contracts, no model classes.

Recomputation, context parallelism and expert parallelism find the part they change by what it *has*,
never its class, so ``parallel/`` imports no model and a user's model gets these strategies by giving its
modules the members below (as :mod:`meshwise.models.gpt` and :mod:`meshwise.models.moe` do). The finders
test members with ``hasattr``: a submodule (an expert layer's ``experts``) lives in ``nn.Module._modules``,
which a runtime protocol check does not see on every Python version.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import Tensor, nn

#: Runs the local experts on tokens grouped by expert: (tokens, rows per local expert) → outputs.
RunExperts = Callable[[Tensor, list[int]], Tensor]
#: Between grouping and combining: (tokens grouped by global expert, rows per global expert, run) →
#: the experts' outputs in the same order.
Exchange = Callable[[Tensor, Tensor, RunExperts], Tensor]


class SplitAttention(Protocol):
    """An attention whose core — softmax(q·kᵀ)·v, causal, with dropout — is one replaceable step:
    ``core(q, k, v)`` on (batch, heads, seq, head dim), called as ``run_core(core, q, k, v)`` when that is
    set (selective recomputation); context parallelism replaces ``core`` (reading dropout and training)."""

    dropout: float
    training: bool
    run_core: Callable[..., Tensor] | None

    def core(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class RecomputableBlock(Protocol):
    """A repeated layer whose whole computation is ``body(x)``, called as ``run_body(body, x)`` when that
    is set (full recomputation sets it). Its split attention, if any, is found among its submodules."""

    run_body: Callable[..., Tensor] | None

    def body(self, x: Tensor) -> Tensor: ...


class RouterCounts(Protocol):
    """An expert layer's router statistics since the last report (summed over forwards)."""

    routed: Tensor  # (experts,) assignments the router chose per expert
    kept: Tensor  # (experts,) of those, the ones under capacity
    balance_loss: Tensor
    z_loss: Tensor
    forwards: int


class ExpertLayer(Protocol):
    """A mixture of experts that expert parallelism can spread over ranks: ``experts`` keyed by *global*
    expert index (a rank holding some keeps the plain names); ``exchange(grouped, counts, run)``, the step
    between grouping tokens by expert and combining, becomes an all-to-all."""

    num_experts: int
    experts: nn.ModuleDict
    exchange: Exchange
    tally: RouterCounts

    def run_local_experts(self, tokens: Tensor, rows: list[int]) -> Tensor: ...

    def reset_tally(self) -> None: ...


def _has(module: nn.Module, members: tuple[str, ...]) -> bool:
    return all(hasattr(module, member) for member in members)


def split_attentions(model: nn.Module) -> list[SplitAttention]:
    """The split attentions under ``model`` (itself included), in forward order."""
    return [m for m in model.modules() if _has(m, ("core", "run_core", "dropout"))]  # type: ignore[misc]


def recomputable_blocks(model: nn.Module) -> list[RecomputableBlock]:
    """The recomputable blocks under ``model`` (a whole model, a pipeline stage, a wrapper), in order."""
    return [m for m in model.modules() if _has(m, ("body", "run_body"))]  # type: ignore[misc]


def expert_layers(model: nn.Module) -> list[ExpertLayer]:
    """The expert layers under ``model``, in order."""
    members = ("num_experts", "experts", "exchange", "tally", "run_local_experts", "reset_tally")
    return [m for m in model.modules() if _has(m, members)]  # type: ignore[misc]
