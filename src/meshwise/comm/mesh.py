"""``Mesh``: the job's ranks arranged on named axes (``dp``, ``tp``, ``pp``), one Communicator per axis.

3D parallelism needs every rank to know three groups: the ranks that hold the other slices of its layers
(tensor parallel), the ranks that hold the same slice of other data (data parallel) and the ranks that hold
the other stages (pipeline). The order follows Megatron-LM: ``tp`` varies fastest, then ``dp``, then
``pp``, so with ``tp`` ≤ GPUs per node a tensor-parallel group — the one that communicates in every layer —
never leaves a node, and pipeline stages — which exchange only activations — are the ones spread across
nodes::

    rank = ((pp_index · dp) + dp_index) · tp + tp_index

:class:`MeshShape` is plain data (coordinates, groups, validation) testable without processes;
:class:`Mesh` splits a Communicator into the per-axis groups over whatever backend it uses. Sizes are
validated before any work starts, with an error that says what to change.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshwise.comm.api import Communicator

#: Axis names, slowest-varying first. ``cp`` and ``ep`` (context, expert parallel) will slot in here.
AXES: tuple[str, ...] = ("pp", "dp", "tp")


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the mesh axes; the product must equal the world size."""

    dp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp

    def validate(self, world_size: int) -> MeshShape:
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"mesh size {axis} must be at least 1, got {getattr(self, axis)}")
        if self.size != world_size:
            raise ValueError(
                f"dp·tp·pp = {self.dp}·{self.tp}·{self.pp} = {self.size} but {world_size} ranks were "
                f"started: start {self.size} ranks (-np {self.size}) or choose sizes whose product is "
                f"{world_size}"
            )
        return self

    @classmethod
    def infer(cls, world_size: int, *, dp: int | None = None, tp: int = 1, pp: int = 1) -> MeshShape:
        """The shape with ``dp`` filled in from the world size when not given (the common case)."""
        if tp < 1 or pp < 1:
            raise ValueError(f"tp and pp must be at least 1, got tp={tp}, pp={pp}")
        if dp is None:
            if world_size % (tp * pp):
                raise ValueError(
                    f"{world_size} ranks cannot be split into tp·pp = {tp}·{pp} = {tp * pp} groups: start a "
                    f"multiple of {tp * pp} ranks or change --tp/--pp"
                )
            dp = world_size // (tp * pp)
        return cls(dp=dp, tp=tp, pp=pp).validate(world_size)

    def coordinates(self, rank: int) -> dict[str, int]:
        """``{"pp": i, "dp": j, "tp": k}`` of a rank."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.size} ranks")
        tp_index = rank % self.tp
        dp_index = (rank // self.tp) % self.dp
        pp_index = rank // (self.tp * self.dp)
        return {"pp": pp_index, "dp": dp_index, "tp": tp_index}

    def rank_of(self, *, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``: ranks that differ only in that coordinate, in coordinate order."""
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r}; choose one of {', '.join(AXES)}")
        others = [a for a in AXES if a != axis]
        groups = []
        for first in range(getattr(self, others[0])):
            for second in range(getattr(self, others[1])):
                fixed = {others[0]: first, others[1]: second}
                groups.append([self.rank_of(**fixed, **{axis: i}) for i in range(getattr(self, axis))])
        return groups

    def group_of(self, axis: str, rank: int) -> list[int]:
        return next(group for group in self.groups(axis) if rank in group)

    def layout_table(self, hosts: Sequence[str] | None = None) -> str:
        """One line per rank: rank → pp/dp/tp coordinates → host (when known)."""
        lines = [f"{'rank':>5}  {'pp':>3} {'dp':>3} {'tp':>3}" + ("  host" if hosts else "")]
        for rank in range(self.size):
            c = self.coordinates(rank)
            line = f"{rank:>5}  {c['pp']:>3} {c['dp']:>3} {c['tp']:>3}"
            lines.append(line + (f"  {hosts[rank]}" if hosts else ""))
        return "\n".join(lines)


class Mesh:
    """Per-axis Communicators of this rank, split from a communicator over the whole job.

    Every rank must build the mesh (the splits are collective over the parent communicator). An axis of
    size 1 still gets a communicator (of one rank), so strategies never special-case a missing axis.
    """

    def __init__(self, comm: Communicator, shape: MeshShape) -> None:
        self.shape = shape.validate(comm.world_size)
        self.rank = comm.rank
        self.coordinates = shape.coordinates(comm.rank)
        self._comms: dict[str, Communicator] = {}
        for axis in AXES:
            for group in shape.groups(axis):
                sub = comm.split(group) if len(group) < comm.world_size else comm
                if comm.rank in group:
                    if sub is None:
                        raise RuntimeError(f"rank {comm.rank} got no communicator for its {axis} group")
                    self._comms[axis] = sub
        self._parent = comm
        self._owns = True

    def __getitem__(self, axis: str) -> Communicator:
        if axis not in self._comms:
            raise KeyError(f"unknown mesh axis {axis!r}; choose one of {', '.join(AXES)}")
        return self._comms[axis]

    @property
    def dp(self) -> Communicator:
        return self._comms["dp"]

    @property
    def tp(self) -> Communicator:
        return self._comms["tp"]

    @property
    def pp(self) -> Communicator:
        return self._comms["pp"]

    def map_axes(self, wrap: Callable[[Communicator], Communicator]) -> Mesh:
        """The same mesh with every axis communicator replaced by ``wrap(comm)`` — e.g. a
        :class:`~meshwise.comm.counting.CountingCommunicator` to account for each axis's traffic. The
        communicators stay this mesh's to close; closing the view closes nothing."""
        view = copy.copy(self)
        view._comms = {axis: wrap(comm) for axis, comm in self._comms.items()}
        view._owns = False
        return view

    def close(self) -> None:
        """Close the sub-communicators this mesh created (not the parent it was split from)."""
        if not self._owns:
            return
        for comm in {id(c): c for c in self._comms.values()}.values():
            if comm is not self._parent:
                comm.close()
