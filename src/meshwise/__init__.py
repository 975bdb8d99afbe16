"""meshwise: take a PyTorch workload from one device to many.

Launch ranks (``meshwise run``), communicate through one :class:`~meshwise.comm.api.Communicator` over
any transport, parallelize training, and measure and diagnose it. Start with :func:`init`.
"""

from meshwise.lazy import lazy_names

# lazily: `meshwise plan` and `meshwise --help` import this package and must not wait for torch
__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "meshwise.comm.api": ("Communicator", "ReduceOp", "Work"),
        "meshwise.world": ("World", "current_world", "init", "shutdown"),
    },
)

__version__ = "0.1.0"

__all__ = ["Communicator", "ReduceOp", "Work", "World", "__version__", "current_world", "init", "shutdown"]
