"""``meshwise.init()`` / ``meshwise.shutdown()``: bring this process into the job, correctly.

Order matters (the seeds' most common pitfall): the device is chosen from the *local* rank and bound
before the process group exists, so NCCL never creates contexts on GPU 0 for every rank. torch.distributed
is always initialised as the control plane (nccl on CUDA, gloo otherwise); the data-plane Communicator
returned in :class:`World` may be another transport (shared memory, MPI) that bootstraps through it.
The World also holds the job's :class:`~meshwise.comm.mesh.Mesh` (named axes pp × dp × ep × cp × tp,
pure data parallelism unless asked otherwise), so a strategy finds its groups where it finds the world
communicator.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: torch.distributed.nn.functional binds
# ``group=group.WORLD`` as default arguments when first imported, and torch's DDP imports it lazily. Imported
# after init, it pins the WORLD group past destroy_process_group(); gloo's worker threads then outlive
# shutdown() and can abort the process at exit ("terminate called without an active exception").
import torch.distributed.nn

from meshwise.comm import flight_recorder
from meshwise.comm.api import CommError, Communicator
from meshwise.comm.debug import DebugChecker, default_store
from meshwise.comm.factory import check_backend, create_communicator
from meshwise.comm.instrumented import InstrumentedCommunicator
from meshwise.comm.mesh import Mesh, MeshShape
from meshwise.comm.shm.segment import check_memory_model
from meshwise.comm.topology import Topology, gather_node_map
from meshwise.runtime.env import LaunchEnv, detect_launch_env, resolve_ipv4
from meshwise.runtime.flight_dumps import DEBUG_ENV, FLIGHT_DIR_ENV
from meshwise.runtime.timeouts import DEFAULT_TIMEOUT_S


@dataclass(frozen=True)
class World:
    """This process's place in the job, the Communicator over all ranks and its per-axis mesh groups."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: torch.device
    backend: str
    launcher: str
    comm: Communicator
    mesh: Mesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_current: World | None = None
_owns_process_group = False
_dump_server: flight_recorder.DumpServer | None = None


def pick_device(layout: LaunchEnv, requested: str | torch.device | None = None) -> torch.device:
    """cuda:local_rank when CUDA is present (or asked for), else the CPU."""
    if requested is not None:
        device = torch.device(requested)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", layout.local_rank % max(1, torch.cuda.device_count()))
        return device
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        count = torch.cuda.device_count()
        if layout.local_world_size > count:
            raise RuntimeError(
                f"{layout.local_world_size} ranks per node but only {count} visible GPUs: start at most "
                f"{count} ranks per node, or pass device='cpu'"
            )
        return torch.device("cuda", layout.local_rank)
    return torch.device("cpu")


def _control_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def resolve_backend(
    requested: str,
    device: torch.device,
    world_size: int,
    *,
    single_host: bool = False,
    ranks_per_node: int | None = None,
) -> str:
    """What ``auto`` means: nccl on GPUs (NCCL is topology-aware itself), shm for several CPU ranks on one
    x86-64 host, ``shm+gloo`` (shared memory inside each node, gloo between) for CPU ranks spread over
    several nodes holding ``ranks_per_node`` > 1 ranks each, gloo otherwise."""
    if requested != "auto":
        check_backend(requested)
        if requested == "nccl" and device.type != "cuda":
            raise ValueError("backend 'nccl' needs CUDA devices; use 'gloo' or 'shm' on CPU")
        if requested == "shm+gloo" and device.type == "cuda":
            raise ValueError(f"backend {requested!r} moves CPU tensors; use 'nccl' (or 'auto') on GPUs")
        return requested
    if device.type == "cuda":
        return "nccl"
    if world_size > 1 and _shm_supported():
        if single_host:
            return "shm"
        if ranks_per_node is not None and ranks_per_node > 1:
            return "shm+gloo"
    return "gloo"


def _shm_supported() -> bool:
    try:
        check_memory_model()
    except CommError:
        return False
    return True


def _on_one_host() -> bool:
    """Whether every rank of the (initialised) world runs on this host, by comparing host names."""
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return len(set(names)) == 1


def adopt_group_layout(layout: LaunchEnv, rank: int, world_size: int) -> LaunchEnv:
    """The launcher's layout corrected to a process group the script created itself: when its size
    differs, the group's rank and size win, and everything else the launcher said (job id, restart count,
    node count, whether the local layout is known) is kept rather than reset to defaults."""
    if world_size == layout.world_size:
        return layout
    return replace(layout, rank=rank, world_size=world_size)


def _init_process_group(layout: LaunchEnv, device: torch.device, timeout: float) -> None:
    backend = _control_backend(device)
    delta = datetime.timedelta(seconds=timeout)
    kwargs: dict = {"backend": backend, "timeout": delta}
    if device.type == "cuda":
        kwargs["device_id"] = device
    if layout.world_size == 1 and layout.master_addr is None:
        store = dist.HashStore()
        dist.init_process_group(store=store, rank=0, world_size=1, **kwargs)
        return
    if layout.master_addr is None or layout.master_port is None:
        raise RuntimeError(
            f"{layout.launcher_name} launched {layout.world_size} ranks but no rendezvous address is known: "
            "set MASTER_ADDR and MASTER_PORT, or launch with `meshwise run`"
        )
    dist.init_process_group(
        init_method=f"tcp://{resolve_ipv4(layout.master_addr)}:{layout.master_port}",
        rank=layout.rank,
        world_size=layout.world_size,
        **kwargs,
    )


def init(
    backend: str = "auto",
    *,
    device: str | torch.device | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    debug: bool | None = None,
    flight_recorder_ops: int = flight_recorder.DEFAULT_CAPACITY,
    mesh: MeshShape | None = None,
    node_map: Sequence[int] | None = None,
) -> World:
    """Join the job described by the environment and return this rank's :class:`World`.

    ``mesh`` arranges the ranks on the mesh axes (default: every rank on ``dp``); its product must equal
    the world size. Idempotent: a second call returns the same World — and refuses another ``mesh``
    rather than silently ignoring it. When torch.distributed was already
    initialised by the script itself (an unmodified torch program), that group is adopted rather than
    replaced.

    ``World.comm`` records its last ``flight_recorder_ops`` operations (dumped on a failure and merged by
    ``meshwise run`` into a hang report). ``debug=True`` checks every collective's fingerprint across
    ranks before it runs and raises on a mismatch; ``None`` follows ``meshwise run --debug``.

    ``node_map`` (the node id of every rank) overrides the launcher's node ranks for ``auto`` and
    ``shm+gloo``: one host then stands in for several nodes, as the tests and benchmarks do.
    """
    global _current, _owns_process_group, _dump_server
    if _current is not None:
        if mesh is not None and mesh != _current.mesh.shape:
            raise ValueError(
                f"meshwise.init(mesh={mesh!r}) but this process already joined with {_current.mesh.shape!r}: "
                "call meshwise.shutdown() first, or build another arrangement with Mesh(world.comm, shape)"
            )
        return _current
    layout = detect_launch_env()
    needs_mpi = layout.master_addr is None or layout.master_port is None or not layout.local_layout_known
    if layout.launcher in ("openmpi", "pmi") and needs_mpi and not dist.is_initialized():
        from meshwise.runtime.mpi_bootstrap import bootstrap_rendezvous  # imports mpi4py: only under MPI

        layout = bootstrap_rendezvous(layout, timeout=timeout)
    if dist.is_initialized():
        layout = adopt_group_layout(layout, dist.get_rank(), dist.get_world_size())
        chosen_device = pick_device(layout, device)
        _owns_process_group = False
    else:
        chosen_device = pick_device(layout, device)
        if chosen_device.type == "cuda":
            torch.cuda.set_device(chosen_device)
        _init_process_group(layout, chosen_device, timeout)
        _owns_process_group = True
    topology = None
    if backend in ("auto", "shm+gloo") and chosen_device.type == "cpu" and dist.get_world_size() > 1:
        topology = Topology(tuple(node_map)) if node_map is not None else gather_node_map(layout)
    single_host = topology is not None and topology.nodes == 1 and _on_one_host()
    per_node = topology.local_size if topology is not None and topology.uniform else None
    name = resolve_backend(
        backend, chosen_device, layout.world_size, single_host=single_host, ranks_per_node=per_node
    )
    options = {"node_map": topology.node_of} if name == "shm+gloo" and topology is not None else {}
    comm = _instrument(create_communicator(name, timeout=timeout, **options), debug, flight_recorder_ops)
    shape = mesh if mesh is not None else MeshShape(dp=dist.get_world_size())
    try:
        with comm.setup():  # the mesh's splits are numbered apart: the user's first collective is #1
            grid = Mesh(comm, shape)
    except BaseException:
        comm.close()
        raise
    flight_dir = os.environ.get(FLIGHT_DIR_ENV)
    if flight_dir:
        _dump_server = flight_recorder.serve_dump_requests(flight_dir, dist.get_rank())
    _current = World(
        rank=dist.get_rank(),
        local_rank=layout.local_rank,
        world_size=dist.get_world_size(),
        local_world_size=layout.local_world_size,
        node_rank=layout.node_rank,
        device=chosen_device,
        backend=name,
        launcher=layout.launcher,
        comm=comm,
        mesh=grid,
    )
    return _current


def _instrument(comm: Communicator, debug: bool | None, capacity: int) -> InstrumentedCommunicator:
    """Wrap the data-plane communicator with the flight recorder and, in debug mode, the checker."""
    if debug is None:
        debug = os.environ.get(DEBUG_ENV) == "1"
    checker = None
    if debug:
        checker = DebugChecker(default_store(), "meshwise-debug", comm.rank, comm.world_size, comm.timeout)
    return InstrumentedCommunicator(comm, capacity=capacity, checker=checker)


def current_world() -> World:
    """The World of the last :func:`init` (raises if there was none)."""
    if _current is None:
        raise RuntimeError("meshwise.init() has not been called in this process")
    return _current


def shutdown() -> None:
    """Close the data-plane Communicator and, if meshwise created it, the process group."""
    global _current, _owns_process_group, _dump_server
    if _dump_server is not None:
        _dump_server.stop()
        _dump_server = None
    try:
        if _current is not None:
            world, _current = _current, None
            world.mesh.close()
            world.comm.close()  # in debug mode this checks that every rank is closing (may raise)
    finally:
        if _owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        _owns_process_group = False
