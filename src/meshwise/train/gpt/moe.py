"""``meshwise train gpt --experts E [--ep N]``: the mixture-of-experts flags, their checks, the router
report and the exchange's profile.

A MoE GPT trains data, tensor (experts whole on every tp rank, which run the same experts on the same
tokens — under ``--sp`` a MoE layer gathers the whole sequence) and pipeline parallel with any schedule;
``--ep N`` spreads every layer's experts over N of the data ranks (:mod:`meshwise.parallel.expert_parallel`)
and ``--zero`` then shards dense weights and experts over their own replicas. What cannot be combined yet
is refused here, before any rank starts, in one line.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from torch import nn

from meshwise.comm.mesh import Mesh
from meshwise.models.gpt import CONFIGS, GPTConfig
from meshwise.models.moe import moe_layers
from meshwise.parallel.expert_parallel import MoEReport, check_expert_parallel, moe_report

if TYPE_CHECKING:
    from meshwise.train.gpt.config import GPTTrainConfig
    from meshwise.train.gpt.sections import ModelSection

#: a MoE layer's block in the plain model's (and a pipeline stage's) names: ``blocks.5.mlp``
BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)\.")
#: ModelSection fields that override the model config's mixture of experts (None: the config's own)
MOE_FIELDS = ("experts", "top_k", "capacity_factor", "aux_loss_coef", "z_loss_coef")


def moe_overrides(model: ModelSection) -> dict[str, int | float | None]:
    return {field: getattr(model, field) for field in MOE_FIELDS}


def check_moe_training(config: GPTTrainConfig, default_model: str) -> None:
    """One clear error for MoE flags this path cannot train; the model's own checks (top-k ≤ E,
    capacity factor > 0) run when the config is built."""
    model = config.model
    named = CONFIGS.get(model.config or default_model)
    experts = model.experts if model.experts is not None else (named.experts if named else 0)
    check_expert_parallel(experts or 0, config.mesh.ep)  # --ep ≥ 1, experts to spread, E divisible by ep
    given = [f"--{field.replace('_', '-')}" for field in MOE_FIELDS[1:] if getattr(model, field) is not None]
    if not experts:
        if given:
            raise ValueError(f"{' '.join(given)} configure a mixture of experts: add --experts E (e.g. 4)")
        return
    for flag in ("aux_loss_coef", "z_loss_coef"):
        value = getattr(model, flag)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"--{flag.replace('_', '-')} must be a number ≥ 0, got {value}")
    hf = (("--init-from", model.init_from), ("--export-hf", config.output.export_hf))  # GPT-2 weights
    if flags := " ".join(flag for flag, path in hf if path is not None):
        raise ValueError(
            f"a mixture of experts cannot train with {flags} yet (Hugging Face GPT-2 weights have no "
            f"experts): drop {flags}"
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


def router_report(model: nn.Module, mesh: Mesh, layers: int) -> MoEReport | None:
    """The router statistics since the last report over the whole job: summed over the ranks that see
    other tokens (``mesh.replicas``: dp·ep·cp; tp ranks route the same ones) and, under ``--pp``, over
    the stages, each of which holds ``blocks.<i>`` of the ``layers``. Collective: every rank calls it."""
    stages = None
    if mesh.pp.world_size > 1:
        moe = set(moe_layers(model))
        names = [name for name, module in model.named_modules() if module in moe]
        positions = [int(BLOCK.search(name).group(1)) for name in names]  # type: ignore[union-attr]
        stages = (mesh.pp, positions, layers)
    return moe_report(model, mesh.replicas, stages=stages)


def expert_exchange(per_step: list[dict[str, float]], step_seconds: float) -> dict[str, float]:
    """``--profile`` figures of ``--ep``: this rank's seconds in the experts' dispatch and combine
    (all-to-alls of counts and tokens, forward and backward) over the profiled steps, and their share."""
    dispatch = sum(step["dispatch"] for step in per_step)
    combine = sum(step["combine"] for step in per_step)
    share = (dispatch + combine) / step_seconds if step_seconds > 0 else 0.0
    return {
        "expert_dispatch_seconds": dispatch,
        "expert_combine_seconds": combine,
        "expert_exchange_share": share,
    }


def expert_exchange_line(profile: dict) -> str:
    return (
        f"expert exchange: dispatch {profile['expert_dispatch_seconds']:.3f} s + combine "
        f"{profile['expert_combine_seconds']:.3f} s = {100 * profile['expert_exchange_share']:.1f} % of the "
        "profiled steps (rank 0, all-to-alls of counts and tokens, forward and backward)"
    )
