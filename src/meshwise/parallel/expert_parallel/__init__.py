"""Expert parallelism: the experts of every mixture-of-experts layer spread over an ``ep`` axis.

``exchange`` moves tokens to their experts' ranks and back with all-to-alls (exact backward);
``placement`` decides which experts a rank keeps and reduces gradients over the right groups; ``report``
is the per-step router statistics; ``data_parallel`` averages dense and expert gradients over their own
replicas in a training loop. The entry point a training step calls is
:func:`apply_expert_parallel` (model, ep Communicator), then :func:`reduce_gradients` after backward.
"""

from meshwise.parallel.expert_parallel.data_parallel import ExpertDataParallel
from meshwise.parallel.expert_parallel.exchange import (
    AllToAllExchange,
    ExchangeTimer,
    all_to_all_rows,
    exchange_rows,
)
from meshwise.parallel.expert_parallel.placement import (
    apply_expert_parallel,
    check_expert_parallel,
    full_expert_state,
    is_expert_parameter,
    local_experts,
    reduce_gradients,
)
from meshwise.parallel.expert_parallel.report import MoEReport, moe_report

__all__ = [
    "AllToAllExchange",
    "ExchangeTimer",
    "ExpertDataParallel",
    "MoEReport",
    "all_to_all_rows",
    "apply_expert_parallel",
    "check_expert_parallel",
    "exchange_rows",
    "full_expert_state",
    "is_expert_parameter",
    "local_experts",
    "moe_report",
    "reduce_gradients",
]
