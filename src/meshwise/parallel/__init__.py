"""Parallel training strategies over a Communicator, one folder per strategy.

``data_parallel/`` (DDP) and ``zero/`` (ZeRO stages 1–3) are here; tensor and pipeline parallelism get
folders of their own beside them.
"""

from meshwise.lazy import lazy_names

# lazily: the recompute formulas and the pipeline bubble are torch-free, and the planner reads them
__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "meshwise.parallel.data_parallel": (
            "Bucket",
            "DataParallel",
            "UnusedParametersError",
            "broadcast_module_state",
            "plan_buckets",
        )
    },
)

__all__ = ["Bucket", "DataParallel", "UnusedParametersError", "broadcast_module_state", "plan_buckets"]
