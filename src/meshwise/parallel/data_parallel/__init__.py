"""Data parallelism (DDP): every rank holds the whole model and averages gradients in buckets.

``buckets`` plans the buckets (plain data), ``reducer`` launches their all-reduces from autograd hooks,
``data`` is the :class:`DataParallel` wrapper that ties them to a module.
"""

from meshwise.parallel.data_parallel.buckets import plan_buckets
from meshwise.parallel.data_parallel.data import DataParallel, broadcast_module_state
from meshwise.parallel.data_parallel.reducer import UnusedParametersError

__all__ = ["DataParallel", "UnusedParametersError", "broadcast_module_state", "plan_buckets"]
