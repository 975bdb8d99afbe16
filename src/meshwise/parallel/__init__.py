"""Parallel training strategies over a Communicator, one folder per strategy.

``data_parallel/`` (DDP) is here; ZeRO, tensor and pipeline parallelism get folders of their own beside it.
"""

from meshwise.parallel.data_parallel import (
    Bucket,
    DataParallel,
    UnusedParametersError,
    broadcast_module_state,
    plan_buckets,
)

__all__ = ["Bucket", "DataParallel", "UnusedParametersError", "broadcast_module_state", "plan_buckets"]
