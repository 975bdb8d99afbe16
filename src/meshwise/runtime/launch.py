"""``meshwise run``: start N worker processes with torchrun's environment contract, and never hang.

Every worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT and
TORCHELASTIC_RESTART_COUNT, so an unmodified ``init_process_group(init_method="env://")`` script works.

No survivors, by construction:
- each worker leads its own session (process group); when any worker fails, the launcher signals the
  whole *group* of every other worker (SIGTERM, then SIGKILL after a grace period), which also reaches
  DataLoader workers and subprocesses they started. A rank stuck inside a collective dies with its
  peers instead of waiting out a 30-minute NCCL/gloo timeout;
- SIGINT / SIGTERM / SIGHUP to the launcher (Ctrl-C, scancel) tear the groups down the same way;
- on Linux each worker is started through a tiny guard that sets PR_SET_PDEATHSIG before ``exec``, so
  even a launcher killed with SIGKILL (which it cannot catch) takes its workers with it, and a
  :class:`~meshwise.runtime.reaper.Reaper` in its own session then kills what those workers started.

Across nodes (one launcher per node), the same: any node's failure, or the loss of a node's launcher,
stops every node's workers, decided in one place (:mod:`meshwise.runtime.coordinator`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from meshwise.runtime.coordinator import Coordinator
from meshwise.runtime.cores import threads_per_rank
from meshwise.runtime.env import MESHWISE_RUN_ID_PREFIX
from meshwise.runtime.flight_dumps import DEBUG_ENV, FLIGHT_DIR_ENV, FlightCollector
from meshwise.runtime.hang_report import render, summarize
from meshwise.runtime.node_link import NodeLink
from meshwise.runtime.output_pump import OutputPump, PrefixedOutput
from meshwise.runtime.preflight import NodeNetwork, PreflightError, plan_network
from meshwise.runtime.reaper import Reaper
from meshwise.runtime.spawn import free_port
from meshwise.runtime.timeouts import DEFAULT_TIMEOUT_S
from meshwise.runtime.worker import WorkerExit, WorkerProcess

#: seconds between SIGTERM and SIGKILL when tearing a group down.
GRACE_SECONDS = 5.0
#: rendezvous port of multi-node launches without --master-port (torchrun's default).
DEFAULT_MASTER_PORT = 29500
#: how often the supervisor checks for a signal to the launcher or the deadline.
_POLL_SECONDS = 0.2
#: exit status for an overall ``timeout`` (the value coreutils' timeout uses).
TIMEOUT_EXIT = 124
#: this node's status when another node's failure stopped its workers (the job's verdict replaces it).
HALTED_EXIT = 1


class LaunchConfigError(ValueError):
    """Bad launch arguments, refused before any process starts."""


@dataclass(frozen=True)
class LaunchPlan:
    """What to start: this node's share of an ``nnodes`` x ``nprocs`` job."""

    cmd: tuple[str, ...]
    nprocs: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int = 0
    timeout: float | None = None
    prefix_output: bool = True

    def validate(self) -> None:
        """Refuse a launch that cannot work, naming the flag to change."""
        if not self.cmd:
            raise LaunchConfigError("no command to launch")
        if shutil.which(self.cmd[0]) is None:
            raise LaunchConfigError(f"cannot find executable {self.cmd[0]!r} (not a file nor on PATH)")
        if self.nprocs < 1:
            raise LaunchConfigError(f"-np/-n must be at least 1, got {self.nprocs}")
        if self.nnodes < 1:
            raise LaunchConfigError(f"--nnodes must be at least 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise LaunchConfigError(
                f"--node-rank {self.node_rank} is outside 0..{self.nnodes - 1} for --nnodes {self.nnodes}"
            )
        if self.nnodes > 1 and not self.master_addr:
            raise LaunchConfigError(
                "--nnodes > 1 needs --master-addr: the address of node 0, reachable from every node "
                "(the same value on every node)"
            )
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise LaunchConfigError(f"--master-port {self.master_port} is outside 1..65535")
        if self.nnodes > 1 and self.master_port == 65535:
            raise LaunchConfigError(
                "--master-port 65535 leaves no port for the launchers, which meet on --master-port + 1"
            )
        if self.max_restarts < 0:
            raise LaunchConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.timeout is not None and self.timeout <= 0:
            raise LaunchConfigError(f"--timeout must be positive, got {self.timeout}")

    @property
    def first_rank(self) -> int:
        return self.node_rank * self.nprocs

    def port(self) -> int:
        """The given port; else a free one on a single node (all nodes must agree, so not there)."""
        if self.master_port is not None:
            return self.master_port
        return free_port(self.address) if self.nnodes == 1 else DEFAULT_MASTER_PORT

    @property
    def address(self) -> str:
        return self.master_addr or "127.0.0.1"

    def worker_environment(self, local_rank: int, port: int, restart: int, run_id: str) -> dict[str, str]:
        """torchrun's per-worker variables for this node's ``local_rank``-th worker."""
        rank, world = self.first_rank + local_rank, self.nnodes * self.nprocs
        return {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(self.nprocs),
            "GROUP_RANK": str(self.node_rank),
            "GROUP_WORLD_SIZE": str(self.nnodes),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world),
            "ROLE_NAME": "default",
            "MASTER_ADDR": self.address,
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": str(restart),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
            "TORCHELASTIC_RUN_ID": run_id,
        }


class _Group:
    """One attempt: start the workers, supervise them, and always tear every one of them down."""

    def __init__(
        self,
        plan: LaunchPlan,
        env: Mapping[str, str],
        output: PrefixedOutput,
        reaper: Reaper,
        flight: FlightCollector,
        link: NodeLink | None = None,
    ) -> None:
        self.plan, self.env, self.output, self.reaper, self.flight = plan, env, output, reaper, flight
        self.link = link
        self.pump = OutputPump(output)
        self.workers: list[WorkerProcess] = []
        self.exits: queue.Queue[WorkerExit] = queue.Queue()
        #: what ended this attempt on this node (None: every worker exited 0), for the other nodes
        self.cause: str | None = None
        #: this node's ranks' flight dumps (multi-node: merged by the coordinator, not here)
        self.dumps: dict[int, dict] = {}

    def run(self, attempt: int, run_id: str) -> tuple[int, bool]:
        """(exit status, whether the launcher itself was interrupted)."""
        plan = self.plan
        self.attempt = attempt
        port = plan.port()
        self.flight.reset()
        with _recorded_signals() as stop:
            try:
                for local in range(plan.nprocs):
                    if stop:
                        break
                    env = {**self.env, **plan.worker_environment(local, port, attempt, run_id)}
                    label = f"[rank {plan.first_rank + local}] " if plan.prefix_output else ""
                    self.workers.append(WorkerProcess(local, plan.cmd, env, self.pump, label))
                    self.reaper.track(self.workers[-1].proc.pid)
                    self.workers[-1].watch(self.exits)
                status = None if stop else self._supervise(stop)
                if status is not None:
                    return status, False
                name = signal.Signals(stop[0]).name
                self.output.write(f"meshwise run: {name} received, stopping all workers\n", to_err=True)
                self.cause = f"node {plan.node_rank}'s launcher received {name}"
                self._flight_report(f"the launcher received {name}")
                return 128 + stop[0], True
            finally:
                self._terminate()

    def _supervise(self, stop: list[int]) -> int | None:
        """Wait for every worker; on the first failure or at the deadline, report and return non-zero.

        None when a signal to the launcher (recorded in ``stop``) cut the wait short.
        """
        timeout = self.plan.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = len(self.workers)
        while pending:
            if stop:
                return None
            if self.link is not None and (order := self.link.poll_interruption()) is not None:
                return self._halt(order["cause"])
            wait = _POLL_SECONDS if deadline is None else min(_POLL_SECONDS, deadline - time.monotonic())
            if wait <= 0:
                message = f"meshwise run: workers still running after {timeout:g} s; terminating them\n"
                self.cause = f"node {self.plan.node_rank}'s workers were still running after {timeout:g} s"
                self.output.write(message, to_err=True)
                self._flight_report(f"workers still running after the {timeout:g} s deadline")
                return TIMEOUT_EXIT
            try:
                ended = self.exits.get(timeout=wait)
            except queue.Empty:
                continue
            pending -= 1
            if ended.returncode != 0:
                self._report(ended)
                return ended.exit_status
        return 0

    def _halt(self, cause: str) -> int:
        """Another node failed or was lost: stop this node's workers, naming why."""
        self.cause = cause
        live = [str(self.plan.first_rank + w.rank) for w in self.workers if w.proc.poll() is None]
        stopping = f"; terminating ranks {', '.join(live)}" if live else ""
        self.output.write(f"meshwise run: {cause}{stopping}\n", to_err=True)
        self._flight_report(cause)
        return HALTED_EXIT

    def _flight_report(self, reason: str) -> None:
        """Collect the live ranks' flight records before anyone is terminated; on one node print the
        summary, on several keep the dumps for the coordinator's merged report."""
        first = self.plan.first_rank

        def alive() -> list[int]:
            return [first + w.rank for w in self.workers if w.proc.poll() is None]

        if self.link is not None:
            self.dumps = self.flight.gather(reason, alive)
            return
        summary = self.flight.collect(reason, alive)
        if summary:
            self.output.write(summary, to_err=True)

    def _report(self, failed: WorkerExit) -> None:
        rank = self.plan.first_rank + failed.rank
        self.cause = f"node {self.plan.node_rank}'s rank {rank} failed ({failed.describe()})"
        if self.link is not None:  # the other nodes stop now, not after this node's flight records
            self.link.send({"kind": "failed", "attempt": self.attempt, "cause": self.cause,
                            "status": failed.exit_status})  # fmt: skip
        self._flight_report(f"rank {rank} failed ({failed.describe()})")
        others = [w for w in self.workers if w.rank != failed.rank and w.proc.poll() is None]
        for worker in others:
            worker.signal_group(signal.SIGTERM)
        first = self.plan.first_rank
        worker = self.workers[failed.rank]
        worker.drain(2.0)  # its last lines (the traceback) come out before the line naming it
        line = f"meshwise run: rank {rank} failed ({failed.describe()})"
        if others:
            line += "; terminating ranks " + ", ".join(str(first + w.rank) for w in others)
        # its stderr was streamed as it was written: point at it rather than print the traceback twice
        line += f" ({'its stderr is above' if worker.tail else 'it wrote nothing to stderr'})"
        self.output.write(line + "\n", to_err=True)

    def _terminate(self) -> None:
        """SIGTERM every worker's process group, SIGKILL what outlives the grace period, reap all."""
        for worker in self.workers:
            worker.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_SECONDS
        for worker in self.workers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(max(0.0, deadline - time.monotonic()))
        for worker in self.workers:
            worker.signal_group(signal.SIGKILL)  # also grandchildren whose leader already exited
            worker.proc.wait()
            self.reaper.release(worker.proc.pid)
            worker.drain(1.0)
        self.pump.close(1.0)


@contextlib.contextmanager
def _recorded_signals() -> Iterator[list[int]]:
    """Record SIGINT/SIGTERM/SIGHUP in the yielded list instead of dying or raising.

    The handler never raises: an exception thrown between ``Popen`` returning and the worker being
    registered would leave that worker unknown to the teardown. The supervisor polls the list instead.
    Signals arriving during the teardown (a second Ctrl-C) are recorded and otherwise ignored.
    """
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum: int, frame: object) -> None:
        received.append(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield received
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def launch(
    cmd: Sequence[str],
    nprocs: int,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str | None = None,
    master_port: int | None = None,
    max_restarts: int = 0,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    prefix_output: bool = True,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    debug: bool = False,
    flight_dir: str | None = None,
) -> int:
    """Run ``cmd`` as ``nprocs`` local workers of an ``nnodes``-node job; return the exit status.

    0 when every worker exits 0. When one fails, the others are terminated and the failed worker's
    status is returned (128 + signal when it was killed), after a line naming its rank and how it ended
    (its stderr, streamed as it was written, is not repeated). ``max_restarts`` relaunches the whole
    local group that many times (TORCHELASTIC_RESTART_COUNT counts them); ``timeout`` bounds each
    attempt's wall time (exit 124). ``env`` adds variables on top of this process's environment.

    With ``nnodes`` > 1 the pre-flight (:mod:`~meshwise.runtime.preflight`) runs first and raises
    PreflightError (a ValueError) with one line; node 0 then also runs the
    :class:`~meshwise.runtime.coordinator.Coordinator`, every node joins it, and a failure anywhere
    halts (and with ``max_restarts`` restarts) every node's workers together.

    Every rank that calls ``meshwise.init()`` records its operations; on a failure, the deadline or an
    interrupt their records are merged into a flight report (in ``flight_dir``, default a temporary
    directory kept only when a report was written). ``debug`` makes ``meshwise.init()`` default to
    debug mode (every collective checked across ranks).
    """
    plan = LaunchPlan(
        tuple(cmd), nprocs, nnodes, node_rank, master_addr, master_port, max_restarts, timeout, prefix_output
    )
    plan.validate()
    output = PrefixedOutput(stdout or sys.stdout, stderr or sys.stderr)
    base_env = {**os.environ, **(env or {})}
    base_env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(nprocs)))  # torchrun's 1 starves CPU ranks
    base_env["PYTHONUNBUFFERED"] = "1"
    flight = FlightCollector(flight_dir, range(plan.first_rank, plan.first_rank + nprocs))
    base_env[FLIGHT_DIR_ENV] = str(flight.directory)
    if debug:
        base_env[DEBUG_ENV] = "1"
    if plan.nnodes > 1:  # refused here, before the launchers meet or any worker starts
        network = plan_network(plan.address, plan.node_rank, base_env)
        base_env.update(network.worker_environment(base_env))
        with _node_link(plan, network, output) as link:
            reaper = Reaper()
            try:
                return _run_nodes(plan, base_env, output, reaper, flight, link)
            finally:
                reaper.close()
                flight.close()
    run_id = f"{MESHWISE_RUN_ID_PREFIX}{os.getpid()}-{int(time.time())}"
    reaper = Reaper()
    try:
        attempt = 0
        while True:
            status, interrupted = _Group(plan, base_env, output, reaper, flight).run(attempt, run_id)
            if status == 0 or interrupted or attempt == max_restarts:
                return status
            attempt += 1
            message = f"meshwise run: restarting all {nprocs} workers (restart {attempt} of {max_restarts})\n"
            output.write(message, to_err=True)
    finally:
        reaper.close()
        flight.close()


@contextlib.contextmanager
def _node_link(plan: LaunchPlan, network: NodeNetwork, output: PrefixedOutput) -> Iterator[NodeLink]:
    """Join the job's launchers (node 0 also starts the coordinator); leave them on the way out."""
    port = plan.port() + 1
    coordinator = None
    if plan.node_rank == 0:
        coordinator = Coordinator(
            network.master_ip, port, plan.nnodes, plan.nprocs, plan.max_restarts, DEFAULT_TIMEOUT_S
        )
    hello = {"node_rank": plan.node_rank, "nnodes": plan.nnodes, "nprocs": plan.nprocs,
             "max_restarts": plan.max_restarts}  # fmt: skip

    def waiting() -> None:
        output.write(
            f"meshwise run: waiting for node 0's launcher at {network.master_ip}:{port}\n", to_err=True
        )

    try:
        link = NodeLink.join(network.master_ip, port, hello, timeout=DEFAULT_TIMEOUT_S, waiting=waiting)
        try:
            yield link
        finally:
            link.close()
    finally:
        if coordinator is not None:
            coordinator.close()


def _run_nodes(
    plan: LaunchPlan,
    env: Mapping[str, str],
    output: PrefixedOutput,
    reaper: Reaper,
    flight: FlightCollector,
    link: NodeLink,
) -> int:
    """This node's part of a multi-node job: run each attempt the coordinator starts, report how it
    ended, and follow the verdict (restart with every node, or exit with the job's status)."""
    announced = None  # the cause the last attempt's workers were halted for, already printed
    dumps: dict[int, dict] = {}  # this node's ranks' flight dumps from the last attempt
    while True:
        order = link.next_order()
        if order["kind"] == "error":
            raise PreflightError(order["message"])
        if order["kind"] == "lost":
            if order["cause"] != announced:
                output.write(f"meshwise run: {order['cause']}; stopping\n", to_err=True)
            if dumps:  # no coordinator left to merge every node's: this node's ranks alone
                reason = f"{order['cause']} (this node's ranks only)"
                text = render(dumps, flight.ranks, reason)
                output.write(flight.write_report(text, summarize(dumps, flight.ranks), reason), to_err=True)
            return HALTED_EXIT
        if order.get("summary"):
            output.write(flight.write_report(order["report"], order["summary"], order["cause"]), to_err=True)
        if order["kind"] == "exit":
            if order["status"]:
                output.write(f"meshwise run: the job failed: {order['cause']}\n", to_err=True)
            return int(order["status"])
        attempt = int(order["attempt"])
        if attempt:
            output.write(
                f"meshwise run: restarting the workers of all {plan.nnodes} nodes (restart {attempt} of "
                f"{plan.max_restarts}) after: {order['cause']}\n",
                to_err=True,
            )
        group = _Group(plan, env, output, reaper, flight, link)
        status, interrupted = group.run(attempt, order["run_id"])
        announced, dumps = group.cause, group.dumps
        link.send({"kind": "ended", "attempt": attempt, "status": status, "cause": group.cause,
                   "dumps": group.dumps})  # fmt: skip
        if interrupted:
            return status


def python_command(script: str, args: Sequence[str], *, module: bool = False) -> list[str]:
    """The worker command for a Python script (or ``-m module``) with this interpreter, unbuffered."""
    if module:
        return [sys.executable, "-u", "-m", script, *args]
    if not os.path.isfile(script):
        where = "" if os.path.isabs(script) else f" (relative to {os.getcwd()})"
        raise LaunchConfigError(f"script {script!r} does not exist{where}")
    return [sys.executable, "-u", script, *args]
