"""Parallel training strategies over a Communicator, one folder per strategy.

``data_parallel/`` (DDP) and ``zero/`` (ZeRO stages 1–3) are here; tensor and pipeline parallelism get
folders of their own beside them.
"""

from meshwise.parallel.data_parallel import (
    Bucket,
    DataParallel,
    UnusedParametersError,
    broadcast_module_state,
    plan_buckets,
)

__all__ = ["Bucket", "DataParallel", "UnusedParametersError", "broadcast_module_state", "plan_buckets"]
