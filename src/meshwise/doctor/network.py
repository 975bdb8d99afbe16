"""Network facts a rendezvous depends on: loopback, a free port, interface names, MASTER_ADDR."""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence

from meshwise.doctor.checks import Check
from meshwise.runtime.env import LaunchEnvError, resolve_ipv4
from meshwise.runtime.preflight import nccl_matches

_TIMEOUT = 5.0


def check_loopback() -> list[Check]:
    """A port can be bound on 127.0.0.1 and bytes go round through it (what a one-node rendezvous does)."""
    try:
        with socket.create_server(("127.0.0.1", 0)) as server:
            port = server.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port), timeout=_TIMEOUT) as client:
                peer, _ = server.accept()
                with peer:
                    client.sendall(b"meshwise")
                    peer.settimeout(_TIMEOUT)
                    echoed = peer.recv(8)
    except OSError as exc:
        return [
            Check(
                "loopback",
                "fail",
                f"cannot open and reach a TCP port on 127.0.0.1 ({exc})",
                "allow local TCP (firewall rules, sandbox network policy) or bring up the lo interface",
            )
        ]
    if echoed != b"meshwise":
        return [
            Check(
                "loopback", "fail", "a loopback connection lost data", "check the lo interface and firewall"
            )
        ]
    return [Check("loopback", "pass", f"free port {port} bound and reached on 127.0.0.1")]


def check_interfaces(env: Mapping[str, str], names: Sequence[str] | None = None) -> list[Check]:
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name interfaces that exist."""
    names = [n for _, n in socket.if_nameindex()] if names is None else list(names)
    present = ", ".join(names)
    found: list[Check] = []
    gloo = env.get("GLOO_SOCKET_IFNAME")
    if gloo:
        missing = [n for n in gloo.split(",") if n not in names]
        if missing:
            found.append(
                Check(
                    "GLOO_SOCKET_IFNAME",
                    "fail",
                    f"{gloo!r} names {', '.join(missing)}, which this "
                    f"machine does not have (it has {present})",
                    f"export GLOO_SOCKET_IFNAME=<one of {present}> or unset it",
                )
            )
        else:
            found.append(Check("GLOO_SOCKET_IFNAME", "pass", f"{gloo} present"))
    nccl = env.get("NCCL_SOCKET_IFNAME")
    if nccl:
        chosen = nccl_matches(nccl, names)
        if not chosen:
            found.append(
                Check(
                    "NCCL_SOCKET_IFNAME",
                    "fail",
                    f"{nccl!r} selects none of this machine's "
                    f"interfaces ({present}): NCCL will fail to bootstrap",
                    f"export NCCL_SOCKET_IFNAME=<prefix of one of {present}> or unset it",
                )
            )
        else:
            found.append(Check("NCCL_SOCKET_IFNAME", "pass", f"{nccl} selects {', '.join(chosen)}"))
    if not found:
        found.append(
            Check("interfaces", "pass", f"{present}; no GLOO/NCCL_SOCKET_IFNAME set (auto-detected)")
        )
    return found


def check_master_addr(env: Mapping[str, str]) -> list[Check]:
    """A MASTER_ADDR set in the environment resolves, and MASTER_PORT is a port."""
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not addr:
        return [
            Check("MASTER_ADDR", "pass", "not set (meshwise run uses 127.0.0.1 and a free port on one node)")
        ]
    try:
        ip = resolve_ipv4(addr)
    except (LaunchEnvError, OSError) as exc:
        return [
            Check(
                "MASTER_ADDR",
                "fail",
                f"{addr!r} does not resolve ({exc})",
                "set MASTER_ADDR to node 0's address or a host name every node resolves",
            )
        ]
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
        return [
            Check("MASTER_PORT", "fail", f"{port!r} is not a port", "set MASTER_PORT to a number in 1..65535")
        ]
    return [Check("MASTER_ADDR", "pass", f"{addr} resolves to {ip}")]


def check_master_route(master_addr: str, port: int, env: Mapping[str, str]) -> list[Check]:
    """What ``meshwise run --nnodes K --master-addr A`` checks before launching, from this node: the
    interface variables, the route to the master (not over loopback) and whether the master answers
    on the launchers' port (``port + 1``). Node 0 is the machine that holds the master address."""
    from meshwise.runtime import netroute
    from meshwise.runtime.node_link import connect
    from meshwise.runtime.preflight import PreflightError, check_interface_variables, find_route

    try:
        known = netroute.interfaces()
        check_interface_variables(env, known)
        local = any(i.address == master_addr for i in known)
        network = find_route(master_addr, 0 if local else 1, known)
    except PreflightError as exc:
        return [Check("route to master", "fail", *str(exc).split("; ", 1))]
    found = [
        Check(
            "route to master",
            "pass",
            f"{network.address} on {network.interface} leads to {network.master_ip}: meshwise run exports "
            f"GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME={network.interface} unless set",
        )
    ]
    if netroute.interface_of(network.master_ip, known) is not None:
        found.append(Check("master", "pass", f"{network.master_ip} is this machine: run --node-rank 0 here"))
        return found
    try:
        connect(network.master_ip, port + 1).close()
        found.append(Check("master", "pass", f"a launcher answers at {network.master_ip}:{port + 1}"))
    except ConnectionRefusedError:
        found.append(
            Check("master", "pass", f"{network.master_ip} answers (no launcher listens on {port + 1} yet)")
        )
    except PreflightError as exc:
        found.append(Check("master", "fail", *str(exc).split("; ", 1)))
    return found
