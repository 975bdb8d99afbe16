"""A node launcher's line to the coordinator: join the job, hear about the other nodes, report its own.

Every node's ``meshwise run`` (node 0's too) connects to the
:class:`~meshwise.runtime.coordinator.Coordinator` on the master, port ``--master-port + 1``, and
exchanges JSON lines:

- node → coordinator: ``hello`` (node rank, nnodes, nprocs, max restarts), ``failed`` (the moment a local
  rank fails, so the others stop at once), ``ended`` (this attempt's workers are all gone; with the local
  flight dumps), ``ping``;
- coordinator → node: ``error`` (the launchers disagree: refused), ``start`` (attempt k, after every node
  ended attempt k-1 — a barrier, so no new worker meets an old one), ``halt`` (another node failed or was
  lost), ``exit`` (the job's verdict), ``ping``.

Both sides ping every :data:`PING_SECONDS`; :data:`SILENCE_SECONDS` without a line means the other side
is lost (its machine died or the network between is cut). A killed launcher is noticed at once: its
kernel closes the connection.
"""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import threading
import time
from collections.abc import Callable

from meshwise.runtime.preflight import PreflightError

#: seconds between pings on an idle link.
PING_SECONDS = 2.0
#: seconds without a line after which the other side is lost.
SILENCE_SECONDS = 15.0
#: bound on one connection attempt to the master: an unreachable master is named within the pre-flight limit.
CONNECT_SECONDS = 2.0
#: after this long without node 0's launcher, say that this one waits for it (once).
WAIT_NOTICE_SECONDS = 10.0


def send_line(sock: socket.socket, lock: threading.Lock, message: dict) -> bool:
    """Send one JSON line; False when the connection is gone."""
    data = (json.dumps(message) + "\n").encode()
    with lock:
        try:
            sock.sendall(data)
        except OSError:
            return False
    return True


def read_lines(sock: socket.socket, deliver: Callable[[dict], None], gone: Callable[[str], None]) -> None:
    """Deliver each JSON line read from ``sock``; call ``gone`` once with why the other side is lost."""
    sock.settimeout(SILENCE_SECONDS)
    pending = b""
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            return gone(f"no word from its launcher for {SILENCE_SECONDS:g} s")
        except OSError as exc:
            return gone(f"its launcher's connection broke ({exc.strerror or exc})")
        if not chunk:
            return gone("its launcher's connection closed (the launcher or its machine died)")
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            try:
                message = json.loads(line)
                if message.get("kind") != "ping":
                    deliver(message)
            except (ValueError, KeyError, TypeError, AttributeError):  # not a meshwise launcher
                return gone(f"it sent a line that is not meshwise's launcher protocol: {line[:60]!r}")


def keep_alive(sock: socket.socket, lock: threading.Lock, stop: threading.Event) -> None:
    """Ping until ``stop`` is set or the connection is gone."""
    while not stop.wait(PING_SECONDS):
        if not send_line(sock, lock, {"kind": "ping"}):
            return


def connect(host: str, port: int) -> socket.socket:
    """A TCP connection to the coordinator's port. ConnectionRefusedError means the master answered
    but nothing listens yet (node 0's launcher may start later); any other failure to connect within
    :data:`CONNECT_SECONDS` is a PreflightError naming the master and what to check."""
    try:
        return socket.create_connection((host, port), timeout=CONNECT_SECONDS)
    except ConnectionRefusedError:
        raise
    except OSError as exc:
        why = "no answer" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise PreflightError(
            f"cannot reach the master {host}:{port} from this node ({why} within {CONNECT_SECONDS:g} s); "
            "check --master-addr is node 0's address and that the network between the nodes lets "
            f"TCP through on ports {port - 1} and {port}"
        ) from None


class NodeLink:
    """This node's connection to the coordinator, and the orders that came over it."""

    def __init__(self, sock: socket.socket, node_rank: int) -> None:
        self.sock, self.node_rank = sock, node_rank
        self.lock = threading.Lock()
        self.orders: queue.Queue[dict] = queue.Queue()
        self.stop = threading.Event()
        self.interruption: dict | None = None
        threading.Thread(target=read_lines, args=(sock, self.orders.put, self._lost), daemon=True).start()
        threading.Thread(target=keep_alive, args=(sock, self.lock, self.stop), daemon=True).start()

    def _lost(self, why: str) -> None:
        if not self.stop.is_set():
            self.orders.put({"kind": "lost", "cause": f"lost node 0, which coordinates the job: {why}"})

    @classmethod
    def join(
        cls, host: str, port: int, hello: dict, *, timeout: float, waiting: Callable[[], None]
    ) -> NodeLink:
        """Connect to the coordinator (it may start later: a refused connection is retried until
        ``timeout``, calling ``waiting`` once after a few seconds) and say hello. An unreachable
        master raises PreflightError."""
        begun = time.monotonic()
        deadline = begun + timeout
        told = False
        while True:
            try:
                sock = connect(host, port)
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise PreflightError(
                        f"no launcher with --node-rank 0 answered at {host}:{port} within {timeout:g} s; "
                        "start node 0's `meshwise run` with the same --master-addr and --master-port"
                    ) from None
                if not told and time.monotonic() - begun > WAIT_NOTICE_SECONDS:
                    waiting()
                    told = True
                time.sleep(0.5)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link = cls(sock, hello["node_rank"])
        link.send({"kind": "hello", **hello})
        return link

    def send(self, message: dict) -> None:
        send_line(self.sock, self.lock, message)

    def next_order(self) -> dict:
        """Block until the coordinator's next ``start``, ``exit`` or ``error`` (or the news that it is
        lost). A ``halt`` is skipped: the workers it was meant to stop are gone already."""
        while True:
            order, self.interruption = self.interruption or self.orders.get(), None
            if order["kind"] != "halt":
                return order

    def poll_interruption(self) -> dict | None:
        """A halt (or loss of the coordinator) that arrived while this node's workers run; kept until
        :meth:`next_order` consumes it."""
        if self.interruption is None:
            with contextlib.suppress(queue.Empty):
                self.interruption = self.orders.get_nowait()
        return self.interruption

    def close(self) -> None:
        self.stop.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
