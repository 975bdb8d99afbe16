"""Expert parallelism: the experts of every mixture-of-experts layer spread over an ``ep`` axis.

``exchange`` moves tokens to their experts' ranks and back with all-to-alls (exact backward);
``placement`` decides which experts a rank keeps (:func:`apply_expert_parallel`, the entry point) and
splits the parameters into dense and expert groups whose gradients average over their own replicas
(:func:`replica_groups`); ``report`` is the per-step router statistics.
"""

from meshwise.parallel.expert_parallel.exchange import AllToAllExchange, ExchangeTimer
from meshwise.parallel.expert_parallel.placement import (
    ExpertReplicas,
    apply_expert_parallel,
    check_expert_parallel,
    is_expert_parameter,
    local_experts,
    replica_groups,
)
from meshwise.parallel.expert_parallel.report import MoEReport, moe_report

__all__ = [
    "AllToAllExchange",
    "ExchangeTimer",
    "ExpertReplicas",
    "MoEReport",
    "apply_expert_parallel",
    "check_expert_parallel",
    "is_expert_parameter",
    "local_experts",
    "moe_report",
    "replica_groups",
]
