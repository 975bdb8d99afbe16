"""Mixed precision for sharded training: what dtype parameters compute in and gradients travel in.

The optimizer always updates float32 master shards, so small updates are not rounded away; the
parameters a unit computes with are a copy in ``param_dtype`` (bf16 halves the bytes of every all-gather
and of the gathered buffers), and gradients are reduce-scattered in ``reduce_dtype``. Our backends
accumulate half-precision reductions in float32 and round once, so bf16 gradients lose only their own
rounding. float16 would need loss scaling to keep small gradients from flushing to zero; that is not
built, so it is refused rather than silently allowed to underflow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NAMES = {"bf16": torch.bfloat16, "fp32": torch.float32}


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
            if value == torch.float16:
                raise ValueError(
                    f"{name}=float16 needs loss scaling, which sharded training does not do yet; "
                    "use torch.bfloat16 (same bytes, float32's range)"
                )
            if value not in (torch.bfloat16, torch.float32):
                raise ValueError(f"{name} must be torch.bfloat16 or torch.float32, got {value}")

    @property
    def gradient_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.param_dtype

    @classmethod
    def parse(cls, value: MixedPrecision | str | None) -> MixedPrecision | None:
        """``None``/``"fp32"`` (full precision), ``"bf16"``, or a MixedPrecision as given."""
        if value is None or isinstance(value, MixedPrecision):
            return value
        if value not in _NAMES:
            raise ValueError(
                f"mixed_precision={value!r} is unknown; use None, 'bf16', 'fp32' or MixedPrecision"
            )
        return None if value == "fp32" else cls(param_dtype=_NAMES[value])
