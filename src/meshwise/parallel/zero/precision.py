"""Mixed precision for sharded training: what dtype parameters compute in and gradients travel in.

The optimizer always updates float32 master shards, so small updates are not rounded away; the
parameters a unit computes with are a copy in ``param_dtype`` (bf16 halves the bytes of every all-gather
and of the gathered buffers), and gradients are reduce-scattered in ``reduce_dtype``. Our backends
accumulate half-precision reductions in float32 and round once, so bf16 gradients lose only their own
rounding. float16 has bf16's bytes but a range that ends at 65504 and flushes gradients below ~6e-8 to
zero, so it only trains with loss scaling (:class:`~meshwise.parallel.zero.scaler.LossScaler`): the loss
is multiplied by a large power of two before backward and the reduced gradient shards divided by it, in
float32, before clipping and the step. :attr:`MixedPrecision.needs_loss_scaling` says when that applies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_HALF = (torch.bfloat16, torch.float16)


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
            if value is None:
                continue
            if value not in (*_HALF, torch.float32):
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
