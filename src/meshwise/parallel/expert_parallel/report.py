"""The per-step router report: how evenly the experts were loaded, what was dropped, the auxiliary losses.

Hot experts are the failure users of MoE training hit (out of memory on the rank that holds them, or
silently dropped tokens under a capacity factor), so the report gives the spread, not just a mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from meshwise.comm.api import Communicator, ReduceOp
from meshwise.parallel.protocols import expert_layers


@dataclass(frozen=True)
class MoEReport:
    """Router statistics since the last report, summed over the data ranks: ``tokens_*`` over every (layer,
    expert) pair, the assignments the router chose it for (before any capacity); ``dropped`` the
    assignments over capacity; the losses are means per layer and forward."""

    tokens_min: int
    tokens_mean: float
    tokens_max: int
    dropped: int
    assignments: int
    balance_loss: float
    z_loss: float

    @property
    def imbalance(self) -> float:
        """Busiest expert over the mean: 1.0 is perfect balance, E means all on one expert."""
        return self.tokens_max / self.tokens_mean if self.tokens_mean else 0.0

    def line(self) -> str:
        dropped = self.dropped / self.assignments if self.assignments else 0.0
        return (
            f"experts: tokens min/mean/max {self.tokens_min}/{self.tokens_mean:.1f}/{self.tokens_max} "
            f"(max/mean {self.imbalance:.2f}), dropped {self.dropped} ({100 * dropped:.1f}%), "
            f"balance loss {self.balance_loss:.3f}, z-loss {self.z_loss:.3f}"
        )


def moe_report(
    model: nn.Module,
    comm: Communicator | None = None,
    *,
    stages: tuple[Communicator, Sequence[int], int] | None = None,
) -> MoEReport | None:
    """The report of ``model``'s MoE layers (None without any), their tallies then reset; collective over
    ``comm`` when given. ``stages`` = (the pp communicator, each local layer's index among all, how many
    there are) sums a pipeline's stages, so every stage reports the whole model."""
    layers = expert_layers(model)
    if not layers:
        return None
    tallies = [layer.tally for layer in layers]
    routed = torch.stack([t.routed.cpu() for t in tallies])  # (layers, E); one host sync per report
    kept = torch.stack([t.kept.cpu() for t in tallies])
    losses = torch.tensor(
        [[t.balance_loss.item(), t.z_loss.item(), t.forwards] for t in tallies], dtype=torch.float64
    )
    if stages is not None:
        pp, positions, total = stages
        rows = torch.tensor(list(positions))
        whole = [torch.zeros((total, *t.shape[1:]), dtype=t.dtype) for t in (routed, kept, losses)]
        for full, mine in zip(whole, (routed, kept, losses), strict=True):
            full[rows] = mine
            pp.all_reduce(full, ReduceOp.SUM)
        routed, kept, losses = whole
    if comm is not None:
        counts = torch.stack([routed, kept])
        comm.all_reduce(counts, ReduceOp.SUM)
        routed, kept = counts[0], counts[1]
        comm.all_reduce(losses, ReduceOp.SUM)
    for layer in layers:
        layer.reset_tally()
    forwards = losses[:, 2].sum().clamp(min=1)
    return MoEReport(
        tokens_min=int(routed.min()),
        tokens_mean=float(routed.float().mean()),
        tokens_max=int(routed.max()),
        dropped=int((routed - kept).sum()),
        assignments=int(routed.sum()),
        balance_loss=float(losses[:, 0].sum() / forwards),
        z_loss=float(losses[:, 1].sum() / forwards),
    )
