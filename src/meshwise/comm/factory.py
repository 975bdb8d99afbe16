"""Build the Communicator for a backend name, over an already initialised torch.distributed group.

torch.distributed (gloo or nccl) is always the control plane: it rendezvouses the ranks, and the other
transports (shared memory, MPI) bootstrap through it. The factory only maps names to implementations;
``meshwise.init`` decides which name ``auto`` means.
"""

from __future__ import annotations

import importlib

import torch.distributed as dist

from meshwise.comm.api import Communicator

#: backend name -> "module:class"; every class offers ``from_process_group(group, timeout=...)``.
BACKENDS = {
    "gloo": "meshwise.comm.native:NativeCommunicator",
    "nccl": "meshwise.comm.native:NativeCommunicator",
    "shm": "meshwise.comm.shm:ShmCommunicator",
    "mpi": "meshwise.comm.mpi.communicator:MpiCommunicator",
}


def create_communicator(
    backend: str, group: dist.ProcessGroup | None = None, *, timeout: float = 300.0
) -> Communicator:
    """The Communicator for ``backend`` over ``group`` (default: the world)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {sorted(BACKENDS)}")
    module_name, class_name = BACKENDS[backend].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls.from_process_group(group, timeout=timeout)
