"""Expert parallelism: the experts of every mixture-of-experts layer spread over an ``ep`` axis.

``exchange`` moves tokens to their experts' ranks and back with all-to-alls (exact backward);
``placement`` decides which experts a rank keeps; ``report`` is the per-step router statistics;
``data_parallel`` splits the parameters into dense and expert groups (:func:`replica_groups`) whose
gradients average over their own replicas — :class:`ExpertDataParallel` for a whole model, a pipeline
stage's reducers for its chunks. The entry point a training step calls is :func:`apply_expert_parallel`
(model, ep Communicator), then one of those.
"""

from meshwise.parallel.expert_parallel.data_parallel import (
    ExpertDataParallel,
    ExpertReplicas,
    replica_groups,
)
from meshwise.parallel.expert_parallel.exchange import (
    AllToAllExchange,
    ExchangeTimer,
    all_to_all_rows,
    exchange_rows,
)
from meshwise.parallel.expert_parallel.placement import (
    apply_expert_parallel,
    check_expert_parallel,
    is_expert_parameter,
    local_experts,
)
from meshwise.parallel.expert_parallel.report import MoEReport, moe_report

__all__ = [
    "AllToAllExchange",
    "ExchangeTimer",
    "ExpertDataParallel",
    "ExpertReplicas",
    "MoEReport",
    "all_to_all_rows",
    "apply_expert_parallel",
    "check_expert_parallel",
    "exchange_rows",
    "is_expert_parameter",
    "local_experts",
    "moe_report",
    "replica_groups",
]
