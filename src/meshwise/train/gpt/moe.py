"""``meshwise train gpt --experts E``: the mixture-of-experts flags, their checks, and the router report.

A MoE GPT trains on one process and under plain data parallelism (every rank holds every expert). Expert
parallelism (``--ep``) and the composition of experts with ``--tp``/``--pp``/``--zero`` belong to the mesh's
``parallelize``, which calls :func:`meshwise.parallel.expert_parallel.apply_expert_parallel`; until then
those combinations are refused here, before any rank starts.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from meshwise.models.gpt import CONFIGS, GPTConfig

if TYPE_CHECKING:
    from meshwise.train.gpt.config import GPTTrainConfig

#: GPTTrainConfig fields that override the model config's mixture of experts (None: the config's own)
MOE_FIELDS = ("experts", "top_k", "capacity_factor", "aux_loss_coef", "z_loss_coef")


def moe_overrides(config: GPTTrainConfig) -> dict[str, int | float | None]:
    return {field: getattr(config, field) for field in MOE_FIELDS}


def check_moe_training(config: GPTTrainConfig, default_model: str) -> None:
    """One clear error for MoE flags this path cannot train; the model's own checks (top-k ≤ E,
    capacity factor > 0) run when the config is built."""
    named = CONFIGS.get(config.config or default_model)
    experts = config.experts if config.experts is not None else (named.experts if named else 0)
    given = [f"--{field.replace('_', '-')}" for field in MOE_FIELDS[1:] if getattr(config, field) is not None]
    if not experts:
        if given:
            raise ValueError(f"{' '.join(given)} configure a mixture of experts: add --experts E (e.g. 4)")
        return
    for flag in ("aux_loss_coef", "z_loss_coef"):
        value = getattr(config, flag)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"--{flag.replace('_', '-')} must be a number ≥ 0, got {value}")
    blocked = [
        flag
        for flag, on in (
            ("--tp", config.tp > 1),
            ("--pp", config.pp > 1),
            ("--zero", config.zero > 0),
            ("--init-from", config.init_from is not None),
            ("--export-hf", config.export_hf is not None),
            # a recomputed block runs its router twice, which would count each step's routing twice
            (f"--recompute {config.recompute}", config.recompute != "none"),
        )
        if on
    ]
    if blocked:
        raise ValueError(
            f"a mixture of experts trains on one process or data parallel (-np N) for now: drop "
            f"{' '.join(blocked)} (expert parallelism and its composition land with the mesh's parallelize; "
            "Hugging Face GPT-2 weights have no experts)"
        )


def moe_banner(model: GPTConfig) -> str | None:
    """The run banner's line for a MoE model: routing and total vs active parameters (None if dense)."""
    if not model.experts:
        return None
    capacity = "dropless" if model.capacity_factor is None else f"capacity factor {model.capacity_factor:g}"
    return (
        f"  mixture of experts: {model.experts} experts per MLP, top-{model.top_k}, {capacity}; "
        f"{model.num_parameters():,} parameters, {model.num_parameters(active=True):,} active per token; "
        f"aux loss × {model.aux_loss_coef:g}, z-loss × {model.z_loss_coef:g}"
    )
