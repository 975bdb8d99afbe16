"""Several "hosts" on one Linux machine: network namespaces joined by a private link, always torn down.

Multi-node code (the launcher's route detection and pre-flight, cross-node failure handling, hierarchical
collectives over a slow link) needs hosts that have *different* network stacks; network namespaces give
each "node" its own interfaces, addresses, routes and loopback, while sharing the file system, ``/dev/shm``
and the host name (so code that tells nodes apart by host name is caught out, as on cloned VMs).

API (tests and ``benchmarks/`` import it the same way, with ``tests/`` on ``sys.path``)::

    from netns import NamespaceCluster, namespaces_unavailable

    reason = namespaces_unavailable()          # None, or why namespaces cannot be made here (skip with it)
    with NamespaceCluster(nodes=2, rate="1gbit") as c:
        c.addresses[0]                         # "10.231.0.1": node 0's address; node i has 10.231.0.(i+1)
        c.interfaces[0]                        # the interface holding it inside node 0's namespace
        proc = c.popen(1, ["python", "x.py"], env={...})    # subprocess.Popen inside node 1
        done = c.run(0, ["ip", "addr"], timeout=10)          # CompletedProcess, text output captured
        c.pids(1); c.kill_all(1)               # processes inside node 1; SIGKILL every one of them
        c.set_link(1, up=False)                # cut node 1 off the link (and back with up=True)

Topology: two nodes are joined by one veth pair; more nodes each get a veth pair to a bridge that lives
in a namespace of its own. Nothing is attached to the calling (root) namespace, so the cluster can reach
no other address and two clusters with the same addresses (parallel test runs) cannot meet. ``rate``
shapes each node's outgoing traffic with ``tc qdisc … tbf`` (netem, which adds delay, is not available
everywhere). Every name carries a random token, so parallel runs never collide.

Teardown is unconditional: the context manager's exit, an ``atexit`` hook and SIGTERM/SIGHUP handlers all
kill every process still inside the namespaces (deleting a namespace alone would leave them running) and
delete the namespaces, which removes their links. A Ctrl-C reaches the context manager as
KeyboardInterrupt. Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and ``ip`` from iproute2.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from functools import cache

#: the private test subnet: node i gets SUBNET.(i+1)/24; only addresses inside our namespaces are used.
SUBNET = "10.231.0"
#: seconds a single ``ip``/``tc`` command may take.
_IP_TIMEOUT = 10.0

_live: list[NamespaceCluster] = []


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT, check=check)


@cache
def namespaces_unavailable() -> str | None:
    """Why network namespaces with veth links cannot be made here, or None when they can.

    Checked once by making (and removing) a namespace with a veth pair inside it, so a test skips with
    the real reason (not root, no iproute2, a container without CAP_SYS_ADMIN, no veth driver).
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN); CI runs these tests as root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"mwprobe-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
        try:
            _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
        finally:
            _ip("netns", "del", probe, check=False)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return f"cannot create a network namespace with a veth pair: {detail.strip()}"
    return None


def _tbf_args(rate: str) -> list[str]:
    """tbf parameters for ``rate`` ("1gbit", "100mbit", "500kbit"): a bucket of 5 ms of traffic, at
    least 256 KiB, since veth hands tbf whole 64 KiB GSO segments and a smaller bucket drops them."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not match:
        raise ValueError(f"rate {rate!r}: write it as tc does, e.g. 1gbit, 100mbit, 500kbit")
    bits = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    burst = max(int(bits / 8 * 0.005), 256 * 1024)
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]


class NamespaceCluster:
    """``nodes`` network namespaces on one link (see the module docstring for the API)."""

    def __init__(self, nodes: int = 2, rate: str | None = None) -> None:
        if not 2 <= nodes <= 250:
            raise ValueError(f"nodes must be in 2..250, got {nodes}")
        self.token = secrets.token_hex(3)
        self.nodes = nodes
        self.rate = rate
        self.names = [f"mw-{self.token}-{i}" for i in range(nodes)]
        self.interfaces = [f"mw{self.token}n{i}" for i in range(nodes)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(nodes)]
        self._switch = f"mw-{self.token}-sw" if nodes > 2 else None
        self._made: list[str] = []  # namespaces created so far, for a teardown after a partial build

    # -- building and tearing down -------------------------------------------------------------
    def __enter__(self) -> NamespaceCluster:
        _install_teardown()
        _live.append(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")  # a new namespace's loopback starts down

    def _build(self) -> None:
        for name in self.names:
            self._add_namespace(name)
        if self._switch is None:
            a, b = self.names
            _ip("-n", a, "link", "add", self.interfaces[0], "type", "veth", "peer", "name",
                self.interfaces[1], "netns", b)  # fmt: skip
        else:
            self._add_namespace(self._switch)
            bridge = f"mw{self.token}br"
            _ip("-n", self._switch, "link", "add", bridge, "type", "bridge")
            _ip("-n", self._switch, "link", "set", bridge, "up")
            for i, name in enumerate(self.names):
                port = f"mw{self.token}p{i}"
                _ip("-n", self._switch, "link", "add", port, "type", "veth", "peer", "name",
                    self.interfaces[i], "netns", name)  # fmt: skip
                _ip("-n", self._switch, "link", "set", port, "master", bridge, "up")
        for name, dev, addr in zip(self.names, self.interfaces, self.addresses, strict=True):
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", name, "link", "set", dev, "up")
            if self.rate:
                subprocess.run(
                    ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", dev, "root",
                     *_tbf_args(self.rate)],
                    capture_output=True, text=True, timeout=_IP_TIMEOUT, check=True,
                )  # fmt: skip
        self._wait_until_linked()

    def _wait_until_linked(self, timeout: float = 10.0) -> None:
        """Block until every node's link reports carrier (veth and bridge ports come up asynchronously)."""
        deadline = time.monotonic() + timeout
        for name, dev in zip(self.names, self.interfaces, strict=True):
            while "LOWER_UP" not in _ip("-n", name, "link", "show", dev).stdout:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{dev} in {name} has no carrier after {timeout:g} s")
                time.sleep(0.05)

    def close(self) -> None:
        """Kill every process inside the namespaces, then delete them (their links go with them)."""
        for name in reversed(self._made):
            _kill_namespace(name)
            _ip("netns", "del", name, check=False)
        self._made.clear()
        with contextlib.suppress(ValueError):
            _live.remove(self)

    # -- using the nodes ------------------------------------------------------------------------
    def command(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.names[node], *argv]

    def popen(
        self, node: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: object
    ) -> subprocess.Popen:
        """Start ``argv`` inside ``node`` (``env`` replaces the environment when given, as for Popen)."""
        return subprocess.Popen(self.command(node, argv), env=None if env is None else dict(env), **kwargs)  # type: ignore[call-overload]

    def run(
        self,
        node: int,
        argv: Sequence[str],
        timeout: float,
        env: Mapping[str, str] | None = None,
        **kwargs: object,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside ``node`` to completion; stdout and stderr captured as text."""
        return subprocess.run(  # type: ignore[call-overload]
            self.command(node, argv),
            env=None if env is None else dict(env),
            timeout=timeout,
            capture_output=True,
            text=True,
            **kwargs,
        )

    def pids(self, node: int) -> list[int]:
        """Every process running inside ``node``'s namespace."""
        return _namespace_pids(self.names[node])

    def kill_all(self, node: int) -> None:
        """SIGKILL every process of ``node``: the node is lost as if it had lost power."""
        _kill_namespace(self.names[node])

    def set_link(self, node: int, up: bool) -> None:
        """Bring ``node``'s interface down (cut off from the others) or back up."""
        _ip("-n", self.names[node], "link", "set", self.interfaces[node], "up" if up else "down")


def _namespace_pids(name: str) -> list[int]:
    listed = _ip("netns", "pids", name, check=False).stdout.split()
    return [int(p) for p in listed if p.isdigit() and int(p) != os.getpid()]


def _kill_namespace(name: str) -> None:
    """SIGKILL the namespace's processes until none is left (a dying one may still fork), at most 5 s."""
    deadline = time.monotonic() + 5.0
    while (pids := _namespace_pids(name)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _teardown_all() -> None:
    for cluster in list(_live):
        cluster.close()


@cache
def _install_teardown() -> None:
    """At interpreter exit and on SIGTERM/SIGHUP, tear down every live cluster, then end as the signal
    would have (the previous handler, or the default action)."""
    atexit.register(_teardown_all)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(signum)

        def handler(sig: int, frame: object, previous: object = previous) -> None:
            _teardown_all()
            if callable(previous):
                previous(sig, frame)
            else:
                signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)

        with contextlib.suppress(ValueError):  # not the main thread: atexit and __exit__ still hold
            signal.signal(signum, handler)
