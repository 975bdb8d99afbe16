"""``Mesh``: the job's ranks arranged on ordered, named axes, one Communicator per axis.

Composed parallelism needs every rank to know one group per strategy: the ranks that hold the other
slices of its layers (``tp``), the other parts of its sequence (``cp``), the other experts (``ep``), the
same slice of other data (``dp``) and the other pipeline stages (``pp``). :data:`AXES` lists them slowest
varying first; a rank's coordinates are the mixed-radix digits of its number, the last axis fastest::

    rank = (((pp_index · dp + dp_index) · ep + ep_index) · cp + cp_index) · tp + tp_index

The order is Megatron-LM's (``tp-cp-ep-dp-pp``, fastest first) and follows how often each group talks:
``tp`` exchanges activations in every layer, forward and backward, so its ranks are neighbours (with
``tp`` ≤ GPUs per node it never leaves a node); ``cp`` passes key/value blocks around a ring in every
attention; ``ep`` does an all-to-all per MoE layer; ``dp`` reduces gradients once per step; ``pp``
sends one activation per micro-batch and stage boundary, so stages are the ones spread across nodes.

Every method is generic over :data:`AXES`: adding an axis is one entry there (and in :data:`BATCH_AXES`
when its ranks read different sequences). An axis of size 1 costs nothing — strategies never special-case
a missing axis. :class:`MeshShape` is plain data (coordinates, groups, validation, the layout table)
testable without processes; :class:`Mesh` splits a Communicator into the per-axis groups over whatever
backend it uses, and bridges to a torch ``DeviceMesh`` over the same ranks (for DCP, or for torch's own
parallel APIs). Degree checks — sizes ≥ 1 whose product is the number of ranks — live here only.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from meshwise.comm.api import Communicator

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: Axis names, slowest varying first (see the module docstring for why this order).
AXES: tuple[str, ...] = ("pp", "dp", "ep", "cp", "tp")

#: Axes whose ranks read different sequences of the global batch (sliced by the loop, loss averaged over
#: them). Expert-parallel ranks are data parallel for every non-expert layer, hence here too; ``cp`` ranks
#: read the *same* sequences (each a part of their length), ``tp`` and ``pp`` ranks the same tokens.
BATCH_AXES: tuple[str, ...] = ("dp", "ep")
#: The groupings over several axes that :class:`Mesh` builds besides one per axis: ``batch`` (ranks that
#: read different sequences), ``replicas`` (ranks holding the same non-expert parameters, which average
#: their gradients: the batch axes and ``cp``, whose ranks see other tokens of the same sequences) and
#: ``expert_replicas`` (ranks holding the same experts: ``ep`` shards them, so it is left out).
GROUPINGS: dict[str, tuple[str, ...]] = {
    "batch": BATCH_AXES,
    "replicas": ("dp", "ep", "cp"),
    "expert_replicas": ("dp", "cp"),
}


def _check_axes(axes: Iterable[str]) -> tuple[str, ...]:
    axes = tuple(axes)
    for axis in axes:
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r}; choose one of {', '.join(AXES)}")
    return axes


class MeshShape:
    """Sizes of the mesh axes (1 for any not given); the product must equal the world size.

    ``MeshShape(dp=2, tp=2)``; ``shape.tp`` reads a size. Immutable, hashable, equal by sizes.
    """

    __slots__ = ("_sizes",)

    def __init__(self, **sizes: int) -> None:
        _check_axes(sizes)
        object.__setattr__(self, "_sizes", tuple(int(sizes.get(axis, 1)) for axis in AXES))

    def __getattr__(self, name: str) -> int:
        if name in AXES:
            return self._sizes[AXES.index(name)]
        raise AttributeError(f"MeshShape has no axis {name!r}; axes are {', '.join(AXES)}")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("MeshShape is immutable; build another one")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MeshShape) and other._sizes == self._sizes

    def __hash__(self) -> int:
        return hash(self._sizes)

    def __repr__(self) -> str:
        return f"MeshShape({', '.join(f'{a}={n}' for a, n in self.sizes.items() if n != 1) or 'dp=1'})"

    def __reduce__(self) -> tuple:  # picklable (spawned ranks receive their config's shape)
        return (_rebuild, (self.sizes,))

    @property
    def sizes(self) -> dict[str, int]:
        """``{axis: size}`` in :data:`AXES` order."""
        return dict(zip(AXES, self._sizes, strict=True))

    @property
    def size(self) -> int:
        return math.prod(self._sizes)

    def describe(self) -> str:
        """``"dp=2 tp=2 pp=1"``: the three axes every run reports (the form results have always used),
        then any other axis of more than one rank (``cp=2``)."""
        reported = ("dp", "tp", "pp")
        extra = [a for a, n in self.sizes.items() if n > 1 and a not in reported]
        return " ".join(f"{a}={getattr(self, a)}" for a in (*reported, *extra))

    def validate(self, world_size: int) -> MeshShape:
        for axis, n in self.sizes.items():
            if n < 1:
                raise ValueError(f"mesh size {axis} must be at least 1, got {n}")
        if self.size != world_size:
            used = {a: n for a, n in self.sizes.items() if n > 1} or {"dp": 1}
            product = f"{'·'.join(used)} = {'·'.join(map(str, used.values()))}"
            product += f" = {self.size}" if len(used) > 1 else ""
            raise ValueError(
                f"{product} but {world_size} ranks were started: start {self.size} ranks (-np {self.size}) "
                f"or choose sizes whose product is {world_size}"
            )
        return self

    @classmethod
    def infer(cls, world_size: int, *, dp: int | None = None, **others: int) -> MeshShape:
        """The shape with ``dp`` filled in from the world size when not given (the common case). Errors
        name the command-line flag (``--tp``) of the axis to change."""
        _check_axes(others)
        for axis, n in others.items():
            if n < 1:
                raise ValueError(f"--{axis} must be at least 1, got {n}")
        fixed = {a: others[a] for a in AXES if others.get(a, 1) > 1}  # in mesh order
        product = math.prod(fixed.values())
        if dp is None:
            names, flags = "·".join(fixed), "/".join(f"--{a}" for a in fixed)
            what = f"--{names} {product}" if len(fixed) == 1 else f"{names} = {product}"
            if product > world_size:
                raise ValueError(
                    f"{what} is larger than the {world_size} ranks started: start at least {product} ranks "
                    f"(-np {product}) or lower {flags}"
                )
            if world_size % product:
                if len(fixed) == 1:
                    raise ValueError(
                        f"{world_size} ranks do not split into groups of {what}: use a divisor of "
                        f"{world_size}"
                    )
                raise ValueError(
                    f"{world_size} ranks cannot be split into {names} = {'·'.join(map(str, fixed.values()))} "
                    f"= {product} groups: start a multiple of {product} ranks or change {flags}"
                )
            dp = world_size // product
        return cls(dp=dp, **others).validate(world_size)

    # ------------------------------------------------------------------ coordinates and groups
    def coordinates(self, rank: int) -> dict[str, int]:
        """``{"pp": i, "dp": j, …, "tp": k}`` of a rank."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.size} ranks")
        coords: dict[str, int] = {}
        for axis, n in reversed(self.sizes.items()):
            rank, coords[axis] = divmod(rank, n)
        return {axis: coords[axis] for axis in AXES}

    def rank_of(self, **coords: int) -> int:
        """The rank at these coordinates (0 along any axis not given)."""
        _check_axes(coords)
        rank = 0
        for axis, n in self.sizes.items():
            rank = rank * n + coords.get(axis, 0)
        return rank

    def groups(self, *axes: str) -> list[list[int]]:
        """Every group along ``axes``: ranks that differ only in those coordinates, each listed in
        row-major order of them (in mesh order, so the last axis varies fastest); groups in rank order."""
        if not axes:
            raise ValueError("groups() needs at least one axis")
        along = [a for a in AXES if a in _check_axes(axes)]
        by_rest: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.size):  # ranks ascending = row-major over `along` inside each group
            c = self.coordinates(rank)
            by_rest.setdefault(tuple(c[a] for a in AXES if a not in along), []).append(rank)
        return sorted(by_rest.values())

    def group_of(self, axis: str, rank: int) -> list[int]:
        return next(group for group in self.groups(axis) if rank in group)

    @property
    def batch_size(self) -> int:
        """How many ranks read different sequences: the product of the :data:`BATCH_AXES` sizes."""
        return math.prod(getattr(self, a) for a in BATCH_AXES)

    def batch_index(self, rank: int) -> int:
        """Which slice of the global batch ``rank`` reads: its row-major position over the batch axes
        (the same as its rank in ``groups(*BATCH_AXES)``, and in ``Mesh.batch``)."""
        coords, index = self.coordinates(rank), 0
        for axis in BATCH_AXES:
            index = index * getattr(self, axis) + coords[axis]
        return index

    def layout_table(self, hosts: Sequence[str] | None = None) -> str:
        """One line per rank: rank → coordinates on every axis of more than one rank → host (when known)."""
        shown = [a for a, n in self.sizes.items() if n > 1] or ["dp"]
        lines = [f"{'rank':>5}  " + " ".join(f"{a:>3}" for a in shown) + ("  host" if hosts else "")]
        for rank in range(self.size):
            c = self.coordinates(rank)
            line = f"{rank:>5}  " + " ".join(f"{c[a]:>3}" for a in shown)
            lines.append(line + (f"  {hosts[rank]}" if hosts else ""))
        return "\n".join(lines)


def _rebuild(sizes: dict[str, int]) -> MeshShape:
    return MeshShape(**sizes)


class Mesh:
    """Per-axis Communicators of this rank, split from a communicator over the whole job.

    Every rank must build the mesh (the splits are collective over the parent communicator). Each axis
    has a communicator, also of size 1; axes whose groups are the same ranks share one (every axis of
    size 1 shares the rank's own), and so do the :data:`GROUPINGS` — ``mesh.batch`` is ``dp``'s while
    ``ep`` is 1: building the mesh costs one collective split per distinct grouping whose groups hold
    more than one rank and fewer than all (a one-rank group is made by its rank alone).
    """

    def __init__(self, comm: Communicator, shape: MeshShape) -> None:
        self.shape = shape.validate(comm.world_size)
        self.rank = comm.rank
        self.coordinates = shape.coordinates(comm.rank)
        self._parent = comm
        self._owns = True
        built: dict[tuple[tuple[int, ...], ...], Communicator] = {}
        self._comms: dict[str, Communicator] = {}
        for name, axes in [*((axis, (axis,)) for axis in AXES), *GROUPINGS.items()]:
            groups = tuple(tuple(g) for g in shape.groups(*axes))
            if groups not in built:
                built[groups] = self._split(comm, groups, name)
            self._comms[name] = built[groups]
        self._device_mesh: DeviceMesh | None = None

    @staticmethod
    def _split(comm: Communicator, groups: tuple[tuple[int, ...], ...], name: str) -> Communicator:
        """This rank's communicator of ``groups``. No split where none is needed: a group of every rank is
        the parent itself, and a group of one rank is made by that rank alone (no other rank takes part,
        so it is no collective); the others are split collectively, every rank calling for every group."""
        mine = None
        for group in groups:
            if len(group) == comm.world_size:
                sub: Communicator | None = comm
            elif len(group) == 1:
                sub = comm.split(group) if comm.rank in group else None
            else:
                sub = comm.split(group)
            if comm.rank in group:
                mine = sub
        if mine is None:
            raise RuntimeError(f"rank {comm.rank} got no communicator for its {name} group")
        return mine

    def __getitem__(self, axis: str) -> Communicator:
        if axis not in self._comms:
            raise KeyError(f"unknown mesh axis {axis!r}; choose one of {', '.join(AXES)}")
        return self._comms[axis]

    def __getattr__(self, axis: str) -> Communicator:
        """``mesh.dp``, ``mesh.tp``, …, and the :data:`GROUPINGS` (``mesh.batch``, ``mesh.replicas``, …)."""
        comms = self.__dict__.get("_comms", {})
        if axis in comms:
            return comms[axis]
        raise AttributeError(f"Mesh has no axis {axis!r}; axes are {', '.join([*AXES, *GROUPINGS])}")

    @property
    def job(self) -> Communicator:
        """The communicator over every rank of the mesh (the one it was split from)."""
        return self._parent

    @property
    def batch_index(self) -> int:
        """This rank's slice of the global batch (of ``shape.batch_size``)."""
        return self._comms["batch"].rank

    def device_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """A torch ``DeviceMesh`` over the same ranks with the same axis names (every axis, size 1
        included), for ``torch.distributed.checkpoint`` and torch's own parallel APIs. Collective the first
        time (torch creates a process group per axis): every rank calls it; needs torch.distributed
        initialised over the same ranks, as :func:`meshwise.init` does."""
        if self._device_mesh is None:
            import torch
            from torch.distributed.device_mesh import DeviceMesh

            ranks = torch.arange(self.shape.size).reshape(tuple(self.shape.sizes.values()))
            self._device_mesh = DeviceMesh(device_type, ranks, mesh_dim_names=AXES)
        return self._device_mesh

    def map_axes(self, wrap: Callable[[Communicator], Communicator]) -> Mesh:
        """The same mesh with every axis communicator replaced by ``wrap(comm)`` — e.g. a
        :class:`~meshwise.comm.counting.CountingCommunicator` to account for each axis's traffic (axes
        sharing a communicator share its wrapper). The communicators stay this mesh's to close; closing
        the view closes nothing."""
        view = copy.copy(self)
        wrapped = {id(c): wrap(c) for c in self._comms.values()}
        view._comms = {axis: wrapped[id(comm)] for axis, comm in self._comms.items()}
        view._owns = False
        return view

    def close(self) -> None:
        """Close the sub-communicators this mesh created (not the parent it was split from)."""
        if not self._owns:
            return
        for comm in {id(c): c for c in self._comms.values()}.values():
            if comm is not self._parent:
                comm.close()
