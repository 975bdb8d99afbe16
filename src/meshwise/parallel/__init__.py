"""Parallel training strategies over a Communicator, one folder per strategy; the data-parallel wrapper
is exported here.
"""

from meshwise.lazy import lazy_names

# lazily: the recompute formulas and the pipeline bubble are torch-free, and the planner reads them
__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "meshwise.parallel.data_parallel": (
            "DataParallel",
            "UnusedParametersError",
            "broadcast_module_state",
            "plan_buckets",
        )
    },
)

__all__ = ["DataParallel", "UnusedParametersError", "broadcast_module_state", "plan_buckets"]
