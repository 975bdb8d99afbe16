"""Parameters that ZeRO shards over ranks of their own: which parameters, over which ranks, which scale.

ZeRO shards what is replicated, over the ranks that replicate it: usually one group for the whole model,
but under expert parallelism a rank's dense weights are equal on every rank of ``mesh.replicas``
(dp·ep·cp) while its experts are equal only on ``mesh.expert_replicas`` (dp·cp). A :class:`ReplicaGroup`
names such a kind of parameter, its ranks, and the factor its averaged gradient needs (an expert's
gradient arrives already summed over the ep ranks' tokens by the combine's backward all-to-all, so it is
divided by ep). Its parameters get flat groups of their own, so every collective on them — reduce-scatter,
all-gather, the checkpoint's pieces — runs over the right ranks.

The gradient norm stays a sum over the model's own ``comm``: the ranks of ``comm`` outside a replica
group's hold *other* parameters of the kind (the other ep ranks' experts), so each element counts once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from meshwise.comm.api import Communicator


@dataclass(frozen=True)
class ReplicaGroup:
    """Parameters ``owns(name, param)`` accepts, replicated over ``comm``: ZeRO shards them over it and
    multiplies their gradients, averaged over it, by ``grad_scale``."""

    name: str
    comm: Communicator
    owns: Callable[[str, nn.Parameter], bool]
    grad_scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.grad_scale > 0:
            raise ValueError(
                f"replica group {self.name!r}: grad_scale must be positive, got {self.grad_scale}"
            )
