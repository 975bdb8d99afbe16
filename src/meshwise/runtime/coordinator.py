"""Node 0's launcher also coordinates the job: who has joined, whether they agree, and what happens
when one node's ranks fail or a whole node is lost.

A small TCP server on ``--master-port + 1`` (the workers' own rendezvous keeps ``--master-port``), run as
threads inside node 0's ``meshwise run``. It owns every cross-node decision, so the launchers never
disagree about it:

- **joining**: each launcher's ``hello`` must carry the same ``--nnodes``, ``-np`` and ``--max-restarts``
  and a node rank nobody else holds; otherwise every launcher is told why and exits 2 before any worker
  starts. When all nodes are in, ``start`` 0.
- **failure**: the first ``failed`` (or a lost connection) is the job's cause; every other node gets
  ``halt`` and stops its workers. When every node has ``ended`` the attempt, the verdict is ``start`` k+1
  (restarts left and no node lost: all nodes restart together) or ``exit`` with the cause.
- **flight records**: each node sends its ranks' dumps with ``ended``; the coordinator merges them into
  one report (silent ranks named, the lost node's included) and sends it with the verdict.

The protocol itself is described in :mod:`meshwise.runtime.node_link`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import threading
import time
from dataclasses import dataclass, field

from meshwise.runtime.hang_report import render, summarize
from meshwise.runtime.node_link import keep_alive, read_lines, send_line
from meshwise.runtime.preflight import PreflightError

#: what every launcher must agree on, with the flag that sets it.
_AGREED = {"nnodes": "--nnodes", "nprocs": "-np", "max_restarts": "--max-restarts"}


@dataclass
class _Member:
    sock: socket.socket
    address: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: threading.Event = field(default_factory=threading.Event)  # its launcher hung up


class Coordinator:
    """The job's referee, serving on ``host:port`` until :meth:`close`."""

    def __init__(
        self, host: str, port: int, nnodes: int, nprocs: int, max_restarts: int, join_timeout: float
    ):
        self.job = {"nnodes": nnodes, "nprocs": nprocs, "max_restarts": max_restarts}
        self.join_timeout = join_timeout
        self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.server.bind((host, port))
        except OSError as exc:
            self.server.close()
            if exc.errno == errno.EADDRINUSE:
                raise PreflightError(
                    f"port {port} on {host} is taken: another launcher with --node-rank 0 runs here "
                    "(colliding node ranks: give each node its own --node-rank) or another job uses "
                    f"--master-port {port - 1}; pick another --master-port on every node"
                ) from None
            raise PreflightError(f"cannot listen on {host}:{port} ({exc.strerror or exc})") from None
        self.server.listen(64)
        self.lock = threading.Lock()
        self.members: dict[int, _Member] = {}
        self.started = False
        self.finished = False
        self.attempt = 0
        self.causes: list[str] = []  # why this attempt failed: lost nodes first, then in arrival order
        self.status = 0  # the job's exit status: that of the attempt's first failure
        self.refusal: str | None = None  # why the job was refused before it started (told to late joiners)
        self.ended: dict[int, dict] = {}
        self.lost: set[int] = set()
        self.run_id = f"meshwise-{os.getpid()}-{int(time.time())}"
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self._join_deadline, daemon=True).start()

    # -- helpers ---------------------------------------------------------------------------------
    def _ranks(self, node: int) -> str:
        first = node * self.job["nprocs"]
        last = first + self.job["nprocs"] - 1
        return f"rank {first}" if first == last else f"ranks {first}-{last}"

    def _send(self, node: int, message: dict) -> None:
        member = self.members.get(node)
        if member is not None:
            send_line(member.sock, member.lock, message)

    def _broadcast(self, message: dict, *, skip: int | None = None) -> None:
        for node in list(self.members):
            if node != skip:
                self._send(node, message)

    def _refuse(self, sock: socket.socket, text: str) -> None:
        """The launchers disagree: before the start tell every one of them (and the newcomer) and stop
        coordinating; a stray launcher arriving after the start is turned away alone."""
        send_line(sock, threading.Lock(), {"kind": "error", "message": text})
        if not self.started:
            self._broadcast({"kind": "error", "message": text})
            self.refusal, self.finished = text, True

    # -- joining ---------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                sock, (address, _) = self.server.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            holder: dict = {}
            threading.Thread(
                target=read_lines,
                args=(sock, lambda m, s=sock, a=address, h=holder: self._on_message(s, a, h, m),
                      lambda why, h=holder: self._on_gone(h, why)),
                daemon=True,
            ).start()  # fmt: skip

    def _join_deadline(self) -> None:
        if self.stop.wait(self.join_timeout):
            return
        with self.lock:
            if self.started or self.finished:
                return
            missing = sorted(set(range(self.job["nnodes"])) - set(self.members))
            text = (
                f"node{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not join within "
                f"{self.join_timeout:g} s; start a `meshwise run` with each missing --node-rank"
            )
            self._broadcast({"kind": "error", "message": text})
            self.refusal, self.finished = text, True

    def _hello(self, sock: socket.socket, address: str, holder: dict, message: dict) -> None:
        node = int(message["node_rank"])
        for key, flag in _AGREED.items():
            if message[key] != self.job[key]:
                return self._refuse(
                    sock,
                    f"{flag} differs between launchers: node 0 says {self.job[key]}, node {node} ({address}) "
                    f"says {message[key]}; pass the same {flag} on every node",
                )
        if node in self.members:
            other = self.members[node].address
            return self._refuse(
                sock,
                f"node rank {node} was claimed by two launchers ({other} and {address}); give each node its "
                f"own --node-rank in 0..{self.job['nnodes'] - 1}",
            )
        holder["node"] = node
        self.members[node] = _Member(sock, address)
        threading.Thread(
            target=keep_alive, args=(sock, self.members[node].lock, self.stop), daemon=True
        ).start()
        if len(self.members) == self.job["nnodes"]:
            self.started = True
            self._broadcast({"kind": "start", "attempt": 0, "run_id": self.run_id})

    # -- running ---------------------------------------------------------------------------------
    def _on_message(self, sock: socket.socket, address: str, holder: dict, message: dict) -> None:
        with self.lock:
            if self.finished:
                # a launcher that says hello after the job was refused (node 0's own link can be the
                # last to arrive) hears the same refusal, rather than nothing until its silence limit
                if message["kind"] == "hello" and self.refusal is not None:
                    send_line(sock, threading.Lock(), {"kind": "error", "message": self.refusal})
                return
            kind = message["kind"]
            if kind == "hello":
                self._hello(sock, address, holder, message)
            elif kind == "failed" and message["attempt"] == self.attempt:
                self._fail(holder["node"], message["cause"], message["status"])
            elif kind == "ended" and message["attempt"] == self.attempt:
                node = holder["node"]
                if message["status"] != 0:
                    self._fail(node, message["cause"], message["status"])
                self.ended[node] = message
                self._decide()

    def _on_gone(self, holder: dict, why: str) -> None:
        with self.lock:
            node = holder.get("node")
            if node is not None and node in self.members:
                self.members[node].closed.set()
            if node is None or self.finished or self.stop.is_set():
                return
            if not self.started:  # left before the job began (refused, or Ctrl-C): it may come back
                del self.members[node]
                return
            self.members.pop(node)
            self.lost.add(node)  # it cannot take part in a restart
            if node in self.ended:  # it reported its end (an interrupted launcher) and then left
                return
            self._fail(node, f"node {node} ({self._ranks(node)}) lost: {why}", 1, lost=True)
            self.ended[node] = {"status": 1, "dumps": {}}
            self._decide()

    def _fail(self, node: int, cause: str, status: int, *, lost: bool = False) -> None:
        """On the attempt's first failure the other nodes halt their workers. A lost node leads the
        causes even when a rank's failure arrived first: its ranks' peers fail at the same moment
        (connections reset), and the loss is what the user must hear about."""
        if cause in self.causes:
            return
        if not self.causes:
            self.status = status
            self._broadcast({"kind": "halt", "cause": cause}, skip=node)
        self.causes.insert(0 if lost else len(self.causes), cause)

    def _decide(self) -> None:
        """Once every node has ended the attempt: restart them all, or tell them the job's outcome."""
        nnodes = self.job["nnodes"]
        if len(self.ended) < nnodes:
            return
        verdict: dict = {"kind": "exit", "status": 0}
        if self.causes:
            cause = "; ".join(self.causes)
            verdict = {"kind": "exit", "status": self.status, "cause": cause, **self._flight_report(cause)}
            if not self.lost and self.attempt < self.job["max_restarts"]:
                self.attempt += 1
                verdict.update(kind="start", attempt=self.attempt, run_id=self.run_id)
        self.ended.clear()
        self.causes = []
        self._broadcast(verdict)
        self.finished = verdict["kind"] == "exit"

    def _flight_report(self, cause: str) -> dict:
        """Every node's dumps merged: the report and its summary, for the verdict (empty without dumps)."""
        dumps = {int(r): d for msg in self.ended.values() for r, d in msg.get("dumps", {}).items()}
        if not dumps:
            return {}
        ranks = range(self.job["nnodes"] * self.job["nprocs"])
        return {"report": render(dumps, ranks, cause), "summary": summarize(dumps, ranks)}

    def close(self, linger: float = 2.0) -> None:
        """Stop serving. Each launcher is given ``linger`` s to hang up first: closing a socket that
        holds unread pings resets the connection, which could destroy the verdict still in flight."""
        self.stop.set()
        with contextlib.suppress(OSError):
            self.server.close()
        deadline = time.monotonic() + linger
        for member in list(self.members.values()):
            with contextlib.suppress(OSError):
                member.sock.shutdown(socket.SHUT_WR)
            member.closed.wait(max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(OSError):
                member.sock.close()
