"""Run a Python function on N local ranks, with the torchrun environment contract, and fail fast.

Used by tests and by every ``-np N`` command that does not go through ``meshwise run``. Children are
forked from a forkserver that has already imported torch, so a rank starts in milliseconds rather than
re-importing torch. When any rank fails or the deadline passes, the others are terminated (then killed)
and the error names the rank, its exit code and its traceback: a broken rank never leaves a hang behind.
If the parent itself dies without cleaning up (SIGTERM from ``scancel``, SIGKILL), every rank notices its
end of a lifeline pipe closing and exits at once instead of computing on, or waiting in a collective,
as an orphan.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from meshwise.runtime.cores import threads_per_rank
from meshwise.runtime.flight_dumps import FLIGHT_DIR_ENV

_GRACE_SECONDS = 3.0


class SpawnError(RuntimeError):
    """A spawned rank raised, exited abnormally, or the group ran past its deadline."""

    def __init__(self, message: str, *, rank: int | None = None, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def rank_environment(rank: int, world_size: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The variables torchrun sets for a single-node rank (an unmodified torch script reads these)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def _exit_with_parent(lifeline: Connection) -> None:
    """Block until the parent's end of the lifeline closes, then end this rank (the parent is gone)."""
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv_bytes()
    os._exit(1)


def _child(
    fn: Callable[..., Any],
    args: Sequence[Any],
    env: Mapping[str, str],
    threads: int,
    conn: Connection,
    lifeline: Connection,
) -> None:
    # A forkserver child's parent is the forkserver, which outlives ours: PR_SET_PDEATHSIG cannot help.
    threading.Thread(target=_exit_with_parent, args=(lifeline,), daemon=True).start()
    os.environ.update(env)
    import torch  # preloaded by the forkserver: free here

    torch.set_num_threads(threads)
    try:
        result = fn(*args)
    except BaseException as exc:  # report everything, including SystemExit, to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        conn.close()
        os._exit(1)
    conn.send(("ok", result, ""))
    conn.close()


#: what the rank server imports before it forks any rank. torch._dynamo is imported by the first optimizer
#: a rank builds (about 1 s, several under load): paying it once in the server spares every training rank.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo")


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _stop(processes: Sequence[mp.process.BaseProcess]) -> None:
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _GRACE_SECONDS
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    *,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    threads: int | None = None,
) -> list[Any]:
    """Call ``fn(*args)`` on ``nprocs`` ranks and return their results in rank order.

    ``fn`` must be importable by name (a module-level function). Each child sees RANK, LOCAL_RANK,
    WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT, plus ``env``, and runs with ``threads``
    torch threads (default: this host's cores shared among the ranks, so ranks do not oversubscribe it).
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}")
    ctx = _context()
    port = free_port()
    threads = threads or threads_per_rank(nprocs)
    processes: list[mp.process.BaseProcess] = []
    pipes: dict[Connection, int] = {}
    lifeline, keepalive = ctx.Pipe(duplex=False)  # only this process holds keepalive: EOF means it died
    try:
        for rank in range(nprocs):
            receiver, sender = ctx.Pipe(duplex=False)
            child_env = {
                **rank_environment(rank, nprocs, "127.0.0.1", port),
                "OMP_NUM_THREADS": str(threads),
                # this process's flight dump directory, if any (a job deadline's), or none: set either way,
                # as the forkserver's own environment may hold an earlier job's
                FLIGHT_DIR_ENV: os.environ.get(FLIGHT_DIR_ENV, ""),
                **(env or {}),
            }
            proc = ctx.Process(
                target=_child,
                args=(fn, tuple(args), child_env, threads, sender, lifeline),
                name=f"meshwise-rank{rank}",
            )
            proc.start()
            sender.close()
            processes.append(proc)
            pipes[receiver] = rank
        lifeline.close()
        return _collect(processes, pipes, timeout)
    finally:  # also when starting a rank failed: the ones already started must not be left behind
        _stop(processes)
        for conn in (lifeline, keepalive, *pipes):
            conn.close()


def _collect(
    processes: Sequence[mp.process.BaseProcess], pipes: dict[Connection, int], timeout: float
) -> list[Any]:
    """Every rank's result in rank order; the first failure or the deadline raises :class:`SpawnError`."""
    nprocs = len(processes)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(results) < nprocs:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pending = sorted(set(range(nprocs)) - set(results))
            raise SpawnError(f"ranks {pending} did not finish within {timeout:g} s (terminated)")
        ready = wait([*pipes, *(p.sentinel for p in processes)], timeout=min(remaining, 0.5))
        for item in ready:
            if isinstance(item, Connection) and item in pipes:
                rank = pipes.pop(item)
                try:
                    status, value, trace = item.recv()
                except EOFError:
                    processes[rank].join(_GRACE_SECONDS)
                    code = processes[rank].exitcode
                    raise SpawnError(
                        f"rank {rank} died without a result ({_describe_exit(code)})",
                        rank=rank,
                        exitcode=code,
                    ) from None
                finally:
                    item.close()
                if status == "error":
                    raise SpawnError(f"rank {rank} failed: {value}\n{trace}", rank=rank, exitcode=1)
                results[rank] = value
        for rank, proc in enumerate(processes):
            if rank not in results and proc.exitcode not in (None, 0) and not _has_pending(pipes, rank):
                raise SpawnError(
                    f"rank {rank} died ({_describe_exit(proc.exitcode)})",
                    rank=rank,
                    exitcode=proc.exitcode,
                )
    return [results[r] for r in range(nprocs)]


def _has_pending(pipes: Mapping[Connection, int], rank: int) -> bool:
    """True while rank's result pipe still has a message to read (its exit may race its report)."""
    for conn, owner in pipes.items():
        if owner == rank:
            return conn.poll()
    return False
