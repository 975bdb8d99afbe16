"""Mixed precision for sharded training (what dtype parameters compute in and gradients travel in) and
the loss scaling float16 needs.

The optimizer always updates float32 master shards, so small updates are not rounded away; units compute
with a copy in ``param_dtype`` (bf16 halves the bytes of every all-gather and gathered buffer), and
gradients are reduce-scattered in ``reduce_dtype`` (our backends accumulate half-precision reductions in
float32 and round once). float16 has bf16's bytes but a range that ends at 65504 and flushes gradients
below ~6e-8 to zero, so it only trains with :class:`LossScaler`: the loss is multiplied by a scale S
before backward and the reduced gradient shards divided by it in float32 before clipping and the step.
S adapts as ``torch.amp.GradScaler``'s does: a step whose gradients hold an inf or nan is skipped and S
backs off; after ``growth_interval`` clean steps S grows. Each rank sees only its shard of the gradient,
so an overflow may show up on one rank alone: the verdict is all-reduced (MAX) before anyone acts on it,
so every rank skips the same steps and keeps the same S.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from meshwise.comm.api import Communicator

if TYPE_CHECKING:
    from meshwise.parallel.zero.sharded import ShardedModel

_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class MixedPrecision:
    """``param_dtype``: compute copies; ``reduce_dtype``: gradient reduction (default: ``param_dtype``,
    as in the ZeRO paper's 2-byte gradients); floating outputs come back as ``output_dtype``."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _NAMES.values():
                raise ValueError(f"{name} must be torch.bfloat16, float16 or float32, got {value}")

    @property
    def gradient_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype

    @property
    def needs_loss_scaling(self) -> bool:
        """float16 compute or reduction: gradients must travel scaled or small ones underflow."""
        return torch.float16 in (self.param_dtype, self.gradient_dtype)

    @classmethod
    def parse(cls, value: MixedPrecision | str | None) -> MixedPrecision | None:
        """``None``/``"fp32"`` (full precision), ``"bf16"``, ``"fp16"`` (with a LossScaler), or a
        MixedPrecision as given."""
        if value is None or isinstance(value, MixedPrecision):
            return value
        if value not in _NAMES:
            raise ValueError(
                f"mixed_precision={value!r} is unknown; use None, 'bf16', 'fp16', 'fp32' or MixedPrecision"
            )
        return None if value == "fp32" else cls(param_dtype=_NAMES[value])


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
        return model.unscale_gradients_(1.0 / self.scale, self.comm)

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
