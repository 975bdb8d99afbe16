"""A mixture of experts' checks and parameter counts, torch-free: the GPT's shape
(:class:`~meshwise.models.gpt_shape.GPTConfig`) validates and counts with them, and the planner imports
that shape without importing the layer (:mod:`meshwise.models.moe`).
"""

from __future__ import annotations

import math


def check_experts(experts: int, top_k: int, capacity_factor: float | None) -> None:
    """A ValueError naming the flag to change when a mixture of experts cannot be built."""
    if experts < 1:
        raise ValueError(f"--experts must be at least 1 (or 0 for the dense MLP), got {experts}")
    if not 1 <= top_k <= experts:
        raise ValueError(
            f"--top-k {top_k} must be between 1 and the number of experts ({experts}): each token picks "
            "top-k distinct experts"
        )
    if capacity_factor is not None and not (math.isfinite(capacity_factor) and capacity_factor > 0):
        raise ValueError(
            f"--capacity-factor must be a positive number (e.g. 1.25), got {capacity_factor}; leave it out "
            "for dropless routing"
        )


def moe_parameter_counts(hidden: int, expert_parameters: int, experts: int, top_k: int) -> tuple[int, int]:
    """(total, active per token) parameters of one MoE layer: the router plus E, resp. k, experts."""
    router = hidden * experts
    return router + experts * expert_parameters, router + top_k * expert_parameters
