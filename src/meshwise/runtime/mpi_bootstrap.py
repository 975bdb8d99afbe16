"""Bring up torch.distributed in a job that MPI started: the seeds' Exercise 4 in Python.

``mpirun`` and ``srun --mpi=pmix`` tell each process its rank and the world size but no rendezvous
address, and many clusters have no torchrun. MPI itself can carry the few bytes torch.distributed needs:
every rank shares its host name (one allgather), rank 0 picks its IPv4 address and a free TCP port and
broadcasts them, and from then on torch.distributed (NCCL or gloo) carries the data, exactly as the C
exercise broadcasts ``ncclUniqueId`` over MPI and then uses NCCL only.

The host names also give the node index of each rank: the order in which its host first appears, which
stays right for any ``--map-by`` policy (not only block mapping). The local rank is the launcher's own
variable; :func:`placement` derives it from host names for launchers that export none.

Both MPI exchanges are non-blocking and polled under the timeout, so a rank that never starts becomes a
clear error rather than a hang. An uncaught exception on any rank then aborts the whole MPI job (as
``python -m mpi4py`` does): without that, the failing rank would block in ``MPI_Finalize`` at exit and
the others would wait for their timeouts.
"""

from __future__ import annotations

import dataclasses
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np

from meshwise.runtime.env import LaunchEnv, LaunchEnvError, resolve_ipv4
from meshwise.runtime.mpi_wait import import_mpi, wait_all
from meshwise.runtime.timeouts import DEFAULT_TIMEOUT_S

#: bytes reserved per host name (Linux HOST_NAME_MAX is 64; fully qualified names stay under 255).
_HOST_BYTES = 256
#: bytes of the "address:port" message rank 0 broadcasts.
_ADDRESS_BYTES = 64
#: pause between printing a fatal traceback and MPI_Abort, so mpirun forwards the text first.
_DRAIN_SECONDS = 0.5
#: an address in TEST-NET-1 (RFC 5737): connecting a UDP socket to it sends nothing but picks the route.
_PROBE_ADDRESS = ("192.0.2.1", 9)


def placement(hosts: Sequence[str], rank: int) -> tuple[int, int, int]:
    """(local rank, ranks on this node, node index) of ``rank`` from every rank's host name.

    Ranks on the same host are numbered in global rank order; nodes in the order their first rank
    appears, so node 0 always holds rank 0.
    """
    nodes: dict[str, list[int]] = {}
    for r, host in enumerate(hosts):
        nodes.setdefault(host, []).append(r)
    mine = nodes[hosts[rank]]
    return mine.index(rank), len(mine), list(nodes).index(hosts[rank])


def _outbound_ipv4() -> str | None:
    """The address of the interface that routes off this node (connecting a UDP socket sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(_PROBE_ADDRESS)
        except OSError:
            return None
        return str(probe.getsockname()[0])


def routable_ipv4() -> str:
    """This host's IPv4 address as other nodes see it (not 127.x, which /etc/hosts often maps it to)."""
    try:
        address: str | None = resolve_ipv4(socket.gethostname())
    except LaunchEnvError:
        address = None
    if address is None or address.startswith("127."):
        address = _outbound_ipv4()
    if address is None or address in ("0.0.0.0", "") or address.startswith("127."):
        raise LaunchEnvError(
            f"rank 0's host {socket.gethostname()!r} has no routable IPv4 address for the other nodes; "
            "export MASTER_ADDR (an IPv4 address of rank 0's node) and MASTER_PORT"
        )
    return address


def free_tcp_port() -> int:
    """A TCP port free on every interface a moment ago (rank 0's torch store binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _exchange(comm: Any, op: str, launch: Any, timeout: float) -> None:
    """Run one non-blocking MPI exchange under ``timeout``; a missing rank becomes a clear error."""
    if not wait_all([launch()], timeout):
        raise LaunchEnvError(
            f"MPI bootstrap ({op}) did not complete within {timeout:g} s on rank {comm.Get_rank()}: a rank "
            "did not start, or does not call meshwise.init()"
        )


def _allgather_hosts(comm: Any, timeout: float) -> list[str]:
    name = socket.gethostname().encode()[:_HOST_BYTES]
    mine = np.zeros(_HOST_BYTES, dtype=np.uint8)
    mine[: len(name)] = np.frombuffer(name, dtype=np.uint8)
    every = np.zeros((comm.Get_size(), _HOST_BYTES), dtype=np.uint8)
    _exchange(comm, "host names", lambda: comm.Iallgather(mine, every), timeout)
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in every]


def _broadcast_address(comm: Any, address: str, timeout: float) -> str:
    buf = np.zeros(_ADDRESS_BYTES, dtype=np.uint8)
    if comm.Get_rank() == 0:
        raw = address.encode()
        buf[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    _exchange(comm, "rendezvous address", lambda: comm.Ibcast(buf, 0), timeout)
    return bytes(buf).rstrip(b"\0").decode()


def abort_job_on_uncaught_exception() -> None:
    """Make an uncaught exception on this rank print its traceback and abort every rank of the job."""
    MPI = import_mpi()

    def hook(kind: type[BaseException], value: BaseException, trace: TracebackType | None) -> None:
        # Written to the real stderr: torch.distributed's own excepthook (installed by
        # init_process_group, which runs later and calls this one) captures sys.stderr to prefix it.
        stream = sys.__stderr__ or sys.stderr
        rank = MPI.COMM_WORLD.Get_rank()
        print(f"meshwise: rank {rank} raised {kind.__name__}; aborting the MPI job", file=stream)
        traceback.print_exception(kind, value, trace, file=stream)
        sys.stdout.flush()
        stream.flush()
        time.sleep(_DRAIN_SECONDS)  # let mpirun forward the traceback before MPI_Abort tears the job down
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = hook


def bootstrap_rendezvous(
    layout: LaunchEnv, *, timeout: float = DEFAULT_TIMEOUT_S, fail_fast: bool = True
) -> LaunchEnv:
    """``layout`` with master_addr/master_port (and the node index) filled in over MPI.

    Every rank of MPI_COMM_WORLD must call it. An exported MASTER_ADDR or MASTER_PORT is kept. When all
    ranks share one host the address is 127.0.0.1, otherwise rank 0's routable IPv4 address; the port is
    one rank 0 found free. ``fail_fast`` first installs :func:`abort_job_on_uncaught_exception`.
    """
    MPI = import_mpi()
    comm = MPI.COMM_WORLD
    if fail_fast:  # first: a rank failing below must not leave the others blocked in MPI_Finalize
        abort_job_on_uncaught_exception()
    if (comm.Get_rank(), comm.Get_size()) != (layout.rank, layout.world_size):
        raise LaunchEnvError(
            f"{layout.launcher} variables say rank {layout.rank} of {layout.world_size} but MPI says rank "
            f"{comm.Get_rank()} of {comm.Get_size()}: unset stale launcher variables in the job script"
        )
    hosts = _allgather_hosts(comm, timeout)
    # The launcher's local rank is kept (Open MPI 5 does not number a node's ranks in global order);
    # the host grouping supplies the node index, which rank // local_size gets wrong under --map-by node.
    local_rank, local_world, node = placement(hosts, layout.rank)
    if layout.local_layout_known:
        local_rank, local_world = layout.local_rank, layout.local_world_size
    message = ""
    if comm.Get_rank() == 0:
        address = layout.master_addr
        if address is None:
            address = "127.0.0.1" if len(set(hosts)) == 1 else routable_ipv4()
        port = layout.master_port if layout.master_port is not None else free_tcp_port()
        message = f"{address}:{port}"
    address, _, port_text = _broadcast_address(comm, message, timeout).rpartition(":")
    return dataclasses.replace(
        layout,
        master_addr=address,
        master_port=int(port_text),
        node_rank=node,
        local_rank=local_rank,
        local_world_size=local_world,
        local_layout_known=True,
        node_count=len(set(hosts)),
    )
