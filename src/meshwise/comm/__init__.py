"""Communication: the Communicator protocol, its backends, collective algorithms and their cost model.

Every parallel strategy talks to a :class:`Communicator` (``meshwise.init().comm``, or
:func:`create_communicator` over a torch.distributed group), never to a transport, so the same code
runs on gloo, NCCL, shared memory (``shm``), shared memory inside nodes and gloo between them
(``shm+gloo``, :mod:`meshwise.comm.two_level`) or MPI; ``meshwise.comm.algorithms.with_algorithm`` swaps
in our algorithms (ring, tree, rd, rhd, pairwise, linear, hierarchical, or ``auto``).

Every rank of a group calls each collective in the same order with matching sizes, dtypes and roots.
Ranks are ``0 … p−1``; "slot i" is the i-th of p pieces of a buffer (equal for flat tensors, per-rank
sizes for the list forms). What each algorithm costs is written once, beside its plan, in
:mod:`meshwise.comm.algorithms.registry` (α-β-γ model, Thakur, Rabenseifner & Gropp 2005, tabulated in
``docs/collectives.md``); ``meshwise bench --help`` lists the algorithms from the same registry.

==============  ====================================================================
collective      result on each rank
==============  ====================================================================
send/recv       ``recv`` gets the tensor ``send`` posted (per pair, in posting order;
                ``isend``/``irecv`` async)
broadcast       root's tensor
scatter         rank i: root's slot i
gather          root: slot i = rank i's tensor
reduce          root: op over all ranks; others unchanged
all_reduce      op over all ranks (in place or into ``output``)
all_gather      slot r = rank r's tensor
reduce_scatter  op over ranks of slot i, on rank i
all_to_all      slot i of rank j = slot j of rank i's input
barrier         returns once every rank has entered
==============  ====================================================================

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

from meshwise.lazy import lazy_names

# lazily: the cost model (comm.cost) and the algorithm registry are torch-free, and the planner reads them
_TORCH_NAMES = {
    "meshwise.comm.api": (
        "CollectiveMismatchError",
        "CommError",
        "CommTimeoutError",
        "Communicator",
        "PeerFailureError",
        "ReduceOp",
        "Work",
    ),
    "meshwise.comm.factory": ("create_communicator",),
}
__getattr__, __dir__ = lazy_names(__name__, _TORCH_NAMES)

__all__ = sorted(name for names in _TORCH_NAMES.values() for name in names)
