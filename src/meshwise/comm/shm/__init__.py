"""Shared-memory transport: single-host CPU collectives through mapped segments (backend name ``shm``)."""

from meshwise.comm.shm.communicator import ShmCommunicator
from meshwise.comm.shm.segment import ShmSpaceError, check_memory_model, plan_layout

__all__ = ["ShmCommunicator", "ShmSpaceError", "check_memory_model", "plan_layout"]
