"""Before a multi-node launch starts anything: find this node's way to the master, or say what is wrong.

Run by every node's ``meshwise run --nnodes K`` (and by ``meshwise doctor --master-addr A``). It resolves
the master, finds the local address and interface that lead to it (:mod:`~meshwise.runtime.netroute`),
refuses a loopback path (the failure every torchrun user meets: gloo advertising 127.0.0.1), and checks
interfaces the user named in GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME. Whether the master answers, and
whether the launchers agree on the job, is checked when they meet (:mod:`~meshwise.runtime.coordinator`).

Every refusal is a :class:`PreflightError`: one line with the cause and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshwise.runtime import netroute
from meshwise.runtime.env import LaunchEnvError, resolve_ipv4

#: the variables that tell gloo and NCCL which interface to bind and advertise.
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class PreflightError(ValueError):
    """This node cannot take part in the multi-node job as configured; the message says what to change."""


@dataclass(frozen=True)
class NodeNetwork:
    """How this node reaches the master: the master's IPv4 address, this node's address towards it and
    the interface that holds that address."""

    master_ip: str
    address: str
    interface: str

    def worker_environment(self, environ: Mapping[str, str]) -> dict[str, str]:
        """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME set to the interface, except those the user set."""
        return {name: self.interface for name in IFNAME_VARIABLES if not environ.get(name)}


def nccl_matches(spec: str, names: Sequence[str]) -> list[str]:
    """Interfaces NCCL_SOCKET_IFNAME selects: comma-separated prefixes; ``=`` exact; ``^`` excludes."""
    exclude = spec.startswith("^")
    body = spec[1:] if exclude else spec
    exact = body.startswith("=")
    body = body[1:] if exact else body
    parts = [p for p in body.split(",") if p]

    def hit(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in parts)

    return [n for n in names if hit(n) != exclude]


def find_route(
    master_addr: str, node_rank: int, known: list[netroute.Interface] | None = None
) -> NodeNetwork:
    """This node's address and interface towards ``master_addr``; PreflightError when there is none
    other nodes could use."""
    known = netroute.interfaces() if known is None else known
    try:
        master_ip = resolve_ipv4(master_addr)
    except (LaunchEnvError, OSError) as exc:
        raise PreflightError(
            f"--master-addr {master_addr!r} does not resolve ({exc}); pass node 0's IPv4 address"
        ) from None
    if netroute.is_loopback(master_ip):
        others = [i for i in known if not i.loopback]
        hint = f" (this machine: {netroute.describe(others)})" if others else ""
        raise PreflightError(
            f"--master-addr {master_addr} is a loopback address, which the other nodes cannot reach; "
            f"pass node 0's address on the network the nodes share{hint}"
        )
    if node_rank == 0 and netroute.interface_of(master_ip, known) is None:
        raise PreflightError(
            f"--node-rank 0 hosts the rendezvous, but --master-addr {master_ip} is not an address of this "
            f"machine (it has {netroute.describe(known)}); run node 0 on {master_ip}, or pass this machine's "
            "address"
        )
    try:
        source = netroute.source_address(master_ip)
    except OSError as exc:
        raise PreflightError(
            f"no route from this machine to the master {master_ip} ({exc.strerror or exc}); check "
            f"--master-addr and this node's network (it has {netroute.describe(known)})"
        ) from None
    interface = netroute.interface_of(source, known)
    if interface is None or interface.loopback:
        raise PreflightError(
            f"the route to the master {master_ip} leaves through the loopback interface "
            f"({interface.name if interface else source}), which other nodes cannot reach; give node 0 an "
            "address on the network the nodes share and pass that as --master-addr"
        )
    return NodeNetwork(master_ip, source, interface.name)


def check_interface_variables(environ: Mapping[str, str], known: list[netroute.Interface]) -> None:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, when set, must select non-loopback interfaces that exist."""
    usable = sorted({i.name for i in known if not i.loopback})
    loopbacks = {i.name for i in known if i.loopback}
    fix = (
        "unset it (meshwise picks the interface that routes to the master) "
        f"or name one of {', '.join(usable)}"
    )
    gloo = environ.get("GLOO_SOCKET_IFNAME")
    if gloo:
        names = [n for n in gloo.split(",") if n]
        missing = [n for n in names if n not in usable and n not in loopbacks]
        if missing:
            raise PreflightError(
                f"GLOO_SOCKET_IFNAME={gloo}: this machine has no interface {missing[0]}; {fix}"
            )
        if any(n in loopbacks for n in names):
            raise PreflightError(
                f"GLOO_SOCKET_IFNAME={gloo} is the loopback interface, which other nodes cannot reach; {fix}"
            )
    nccl = environ.get("NCCL_SOCKET_IFNAME")
    if nccl:
        chosen = nccl_matches(nccl, [*usable, *sorted(loopbacks)])
        if not chosen:
            raise PreflightError(
                f"NCCL_SOCKET_IFNAME={nccl} selects none of this machine's interfaces; {fix}"
            )
        if all(n in loopbacks for n in chosen):
            raise PreflightError(
                f"NCCL_SOCKET_IFNAME={nccl} selects only the loopback interface, which other nodes cannot "
                f"reach; {fix}"
            )


def plan_network(master_addr: str, node_rank: int, environ: Mapping[str, str]) -> NodeNetwork:
    """Every local pre-flight check for one node of a multi-node job; the network it will use."""
    known = netroute.interfaces()
    check_interface_variables(environ, known)
    return find_route(master_addr, node_rank, known)
