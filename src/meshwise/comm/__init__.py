"""Communication: the Communicator protocol, its backends, collective algorithms and their cost model.

Every parallel strategy talks to a :class:`Communicator` (``meshwise.init().comm``, or
:func:`create_communicator` over a torch.distributed group), never to a transport, so the same code
runs on gloo, NCCL, shared memory (``shm``) or MPI; ``meshwise.comm.algorithms.with_algorithm`` swaps
in our algorithms (ring, tree, rd, rhd, pairwise, linear, hierarchical, or ``auto``).

Every rank of a group calls each collective in the same order with matching sizes, dtypes and roots.
Ranks are ``0 … p−1``; "slot i" is the i-th of p pieces of a buffer (equal for flat tensors, per-rank
sizes for the list forms). Cost is the α-β-γ model of :mod:`meshwise.comm.cost` (Thakur, Rabenseifner &
Gropp 2005) for the best algorithm: α per message, β per byte moved, γ per byte reduced, n the bytes of
the whole vector (all slots together for the slotted collectives), lg = ⌈log₂ p⌉.

==============  =================================================  ===========================================
collective      result on each rank                                time (algorithm)
==============  =================================================  ===========================================
send/recv       ``recv`` gets the tensor ``send`` posted (per       α + nβ
                pair, in posting order; ``isend``/``irecv`` async)
broadcast       root's tensor                                      lg·(α + nβ) (tree)
scatter         rank i: root's slot i                              lg·α + (p−1)/p·nβ (tree; ours sends the
                                                                   per-rank slot sizes first: + lg·α)
gather          root: slot i = rank i's tensor                     as scatter
reduce          root: op over all ranks; others unchanged           lg·(α + nβ + nγ) (tree)
all_reduce      op over all ranks (in place or into ``output``)    small n: lg p·(α + nβ + nγ) (rd);
                                                                   large n: 2(p−1)α + 2(p−1)/p·nβ +
                                                                   (p−1)/p·nγ (ring), 2·lg p·α + same (rhd)
all_gather      slot r = rank r's tensor                           lg p·α + (p−1)/p·nβ (rd), (p−1)α + … (ring)
reduce_scatter  op over ranks of slot i, on rank i                  lg p·α + (p−1)/p·n(β + γ) (rhd)
all_to_all      slot i of rank j = slot j of rank i's input         (p−1)α + (p−1)/p·nβ (pairwise)
barrier         returns once every rank has entered                 one latency-bound round
==============  =================================================  ===========================================

Worked example (the seeds, 4 ranks): rank r holding ``[r+1]`` gives reduce → root ``[10]`` (others keep
their input), all_reduce → ``[10]`` everywhere, all_gather → ``[1 2 3 4]`` everywhere; rank r holding
``[r+1 … r+4]`` gives reduce_scatter → ``[10] [14] [18] [22]``; and all_reduce = reduce_scatter +
all_gather. Reduce ops: SUM, AVG, MAX, MIN, PROD; dtypes float32/64, bfloat16, float16 (reduced in float32
and rounded once), int32/64 (AVG refused). ``async_op=True`` returns a :class:`Work` with ``wait()`` and
``is_completed()``. Failures are :class:`CommError` subclasses naming the rank and the operation: a
:class:`CommTimeoutError` for a silent peer, :class:`PeerFailureError` for a dead one,
:class:`CollectiveMismatchError` for ranks that called different things (always on ``shm``; over gloo,
which aborts the process on a size mismatch, with ``with_algorithm(..., check_consistency=True)``).
When ranks share cores, exchange steps (every rank sends and receives: ring, rd, rhd, pairwise) also
cost σ each plus δ per byte they move, and one-way tree steps do not (fitted per world size).
docs/collectives.md has the per-algorithm costs, the non-power-of-two folding and how ``auto`` chooses.
"""

from meshwise.comm.api import (
    CollectiveMismatchError,
    CommError,
    CommTimeoutError,
    Communicator,
    PeerFailureError,
    ReduceOp,
    Work,
)
from meshwise.comm.factory import create_communicator

__all__ = [
    "CollectiveMismatchError",
    "CommError",
    "CommTimeoutError",
    "Communicator",
    "PeerFailureError",
    "ReduceOp",
    "Work",
    "create_communicator",
]
