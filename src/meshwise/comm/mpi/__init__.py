"""MPI transport over mpi4py, for jobs started by ``mpirun``/``srun`` (backend name ``mpi``).

mpi4py is imported only when a communicator is built, so importing this package needs no MPI.
"""

from meshwise.comm.mpi.communicator import MpiCommunicator

__all__ = ["MpiCommunicator"]
