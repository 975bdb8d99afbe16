"""Build the Communicator for a backend name, over an already initialised torch.distributed group.

torch.distributed (gloo or nccl) is always the control plane: it rendezvouses the ranks, and the other
transports (shared memory, MPI) bootstrap through it. The factory only maps names to implementations;
``meshwise.init`` decides which name ``auto`` means.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist

from meshwise.comm.api import Communicator
from meshwise.runtime.env import check_mpi_launch
from meshwise.runtime.timeouts import DEFAULT_TIMEOUT_S

#: backend name -> "module:class"; every class offers ``from_process_group(group, timeout=...)``.
BACKENDS = {
    "gloo": "meshwise.comm.native:NativeCommunicator",
    "nccl": "meshwise.comm.native:NativeCommunicator",
    "shm": "meshwise.comm.shm:ShmCommunicator",
    "mpi": "meshwise.comm.mpi.communicator:MpiCommunicator",
    # several nodes on CPUs: shared memory inside each node, gloo between nodes (meshwise.comm.two_level)
    "shm+gloo": "meshwise.comm.two_level:TwoLevelCommunicator",
}


def transport_levels(backend: str, nodes: int) -> dict[str, str]:
    """Which transport serves each level of a job on ``backend`` over ``nodes`` nodes (what ``meshwise
    info`` and the benchmarks print): a composite name ``intra+inter`` names both, a single backend serves
    both levels (NCCL and gloo route inside and between nodes themselves), and a one-node job has no
    inter-node level."""
    intra, _, inter = backend.partition("+")
    return {"intra-node": intra, "inter-node": (inter or intra) if nodes > 1 else "-"}


def check_backend(name: str, *, allow_auto: bool = True, what: str = "backend") -> str:
    """``name`` when it is a backend of :data:`BACKENDS` (or ``auto`` where that is allowed), else a
    ValueError that names ``what`` (e.g. ``--backend``) and the choices: the one check every entry point
    (``init``, the factory, the train/π/bench configs) makes before any rank starts."""
    if name in BACKENDS or (allow_auto and name == "auto"):
        return name
    choices = ("auto or " if allow_auto else "") + "one of " + ", ".join(sorted(BACKENDS))
    raise ValueError(f"{what} {name!r} is unknown; choose {choices}")


def check_backend_here(name: str, *, device: str | None, command: str, what: str = "--backend") -> str:
    """:func:`check_backend`, then whether ``name`` can run in this process, before any rank starts:
    ``nccl`` needs CUDA (a CPU run would fail in every rank's init), ``mpi`` an MPI launcher (a
    singleton MPI_Init fails with a traceback and leaves Open MPI's segments in /dev/shm)."""
    check_backend(name, what=what)
    if name == "nccl" and (device == "cpu" or not torch.cuda.is_available()):
        where = "the run is on --device cpu" if device == "cpu" else "CUDA is not available here"
        raise ValueError(f"{what} nccl needs CUDA GPUs, but {where}; use --backend gloo or shm (or auto)")
    if name == "mpi":
        check_mpi_launch(command)
    return name


def create_communicator(
    backend: str,
    group: dist.ProcessGroup | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    **options: Any,
) -> Communicator:
    """The Communicator for ``backend`` over ``group`` (default: the world); ``options`` go to the
    backend's ``from_process_group`` (e.g. ``node_map=`` for ``shm+gloo``)."""
    check_backend(backend, allow_auto=False)
    module_name, class_name = BACKENDS[backend].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls.from_process_group(group, timeout=timeout, **options)
