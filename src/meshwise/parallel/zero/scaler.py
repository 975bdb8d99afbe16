"""Dynamic loss scaling for float16 sharded training, with the overflow check agreed over the ranks.

float16 flushes gradient values below ~6e-8 to zero and overflows above 65504. Multiplying the loss by a
large scale S before backward lifts small gradients into range; the reduced gradient shards are divided
by S again — in float32, on their way to the optimizer — before clipping and the step. S adapts as
``torch.amp.GradScaler`` adapts it: a step whose gradients hold an inf or nan is skipped and S multiplied
by ``backoff_factor``; after ``growth_interval`` clean steps in a row S is multiplied by ``growth_factor``.

The one thing sharding adds: each rank sees only its shard of the gradient, so an overflow may show up on
one rank alone. The verdict is all-reduced (MAX) before anyone acts on it, so every rank skips the same
steps and keeps the same S, and the shards never drift apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from meshwise.comm.api import Communicator, ReduceOp

if TYPE_CHECKING:
    from meshwise.parallel.zero.sharded import ShardedModel


class LossScaler:
    """``scale(loss)`` before backward; :meth:`unscale_` before clipping; :meth:`update` after the step
    (the step is a no-op when :meth:`unscale_` found an overflow: it discarded the gradients)."""

    def __init__(
        self,
        comm: Communicator,
        *,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(
                "loss scaling needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
                f"growth_interval ≥ 1; got {init_scale}, {growth_factor}, {backoff_factor}, {growth_interval}"
            )
        self.comm = comm
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0  # clean steps since the scale last changed
        self.skipped = 0  # steps skipped for an overflow, over this scaler's life

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, model: ShardedModel) -> bool:
        """Divide ``model``'s reduced gradient shards by the scale; return whether ANY rank found an inf
        or nan (then every rank discarded its gradients, so the optimizer step changes nothing)."""
        local = model.unscale_gradients_(1.0 / self.scale)
        flag = torch.tensor([1.0 if local else 0.0], device=model.groups[0].device)
        self.comm.all_reduce(flag, ReduceOp.MAX)
        found = bool(flag.item() > 0)
        if found:
            model.discard_gradients()
        return found

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow; grow after ``growth_interval`` clean steps (GradScaler's rule)."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        """As tensors, so a DCP checkpoint carries them and a resumed run scales exactly as before."""
        return {
            "scale": torch.tensor(self.scale, dtype=torch.float64),
            "growth_tracker": torch.tensor(self.growth_tracker, dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
