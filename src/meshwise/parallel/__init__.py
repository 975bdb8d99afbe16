"""Parallel training strategies over a Communicator; data parallelism (DDP) first."""

from meshwise.parallel.buckets import Bucket, plan_buckets
from meshwise.parallel.data import DataParallel, broadcast_module_state
from meshwise.parallel.reducer import UnusedParametersError

__all__ = ["Bucket", "DataParallel", "UnusedParametersError", "broadcast_module_state", "plan_buckets"]
