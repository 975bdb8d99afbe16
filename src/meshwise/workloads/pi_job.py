"""Run a π workload on every rank of a :class:`~meshwise.world.World` and report like the seeds.

Timing follows the seeds' exercise 2: ranks meet at a barrier, each times its own computation (device
synchronised), the partial results are combined with the Communicator's all_reduce (int64 hit counts,
float64 sums), and the wall time is the slowest rank's barrier-to-result time. The per-rank compute and
combine times are kept so a scaling study can tell communication cost from load imbalance.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import torch

from meshwise.comm.api import ReduceOp
from meshwise.comm.factory import check_backend
from meshwise.runtime.cores import threads_per_rank
from meshwise.runtime.env import check_mpi_launch
from meshwise.runtime.heartbeat import heartbeat
from meshwise.runtime.timeouts import wait_timeout
from meshwise.workloads.pi import (
    METHODS,
    check_work,
    estimate_from_hits,
    midpoint_partial,
    montecarlo_hits,
    split_range,
)
from meshwise.workloads.pi_fused import midpoint_partial_fused, montecarlo_hits_fused
from meshwise.world import World, init, shutdown

KERNELS = ("auto", "eager", "fused")
#: ``auto`` compiles the fused kernel once a rank's share reaches this many items: eager needs about a
#: second per core for it, so the one-time compilation (seconds, cached on disk afterwards) pays off.
FUSED_FROM_ITEMS = 1 << 27

_WARMUP_ITEMS = 1 << 18


@dataclass(frozen=True)
class RankStats:
    """One rank's share: its items, its partial result and how long computing and combining took."""

    rank: int
    local_rank: int
    local_world_size: int
    device: str
    items: int
    hits: int  # Monte Carlo hits (0 for midpoint)
    partial: float  # midpoint partial sum (hits·4/N for Monte Carlo)
    compute_seconds: float
    total_seconds: float  # barrier to combined result


@dataclass(frozen=True)
class PiReport:
    """The combined result, identical on every rank."""

    method: str
    n: int
    world_size: int
    estimate: float
    total_hits: int | None
    standard_error: float | None
    wall_seconds: float
    ranks: tuple[RankStats, ...]

    @property
    def abs_error(self) -> float:
        return abs(self.estimate - math.pi)

    @property
    def comm_seconds(self) -> float:
        """Combine time of the slowest rank beyond its compute (communication plus waiting for peers)."""
        slowest = max(self.ranks, key=lambda r: r.total_seconds)
        return slowest.total_seconds - slowest.compute_seconds

    def format(self) -> str:
        """Per-rank lines and the ``===== FINAL RESULTS =====`` block in the seeds' layout."""
        lines = []
        for r in self.ranks:
            head = (
                f"rank {r.rank}/{self.world_size} | local_rank {r.local_rank}/{r.local_world_size} | "
                f"device {r.device}"
            )
            if self.method == "montecarlo":
                body = f"samples = {r.items} | hits = {r.hits}"
            else:
                body = f"bins = {r.items} | partial pi = {r.partial:.15f}"
            lines.append(f"{head} | {body} | time = {r.compute_seconds:.6f} s")
        label = "Estimated PI" if self.method == "montecarlo" else "Computed PI"
        lines += ["", "===== FINAL RESULTS =====", f"Exact PI       = {math.pi:.8f}"]
        lines.append(f"{label:<14} = {self.estimate:.8f}")
        lines.append(f"Absolute error = {self.abs_error:.8e}")
        lines.append(f"Relative error = {self.abs_error / math.pi * 100:.8e} %")
        if self.method == "montecarlo":
            lines.append(f"Total hits     = {self.total_hits}")
            lines.append(f"Total samples  = {self.n}")
            lines.append(f"Standard error = {self.standard_error:.8e}")
        else:
            lines.append(f"Total bins     = {self.n}")
        lines.append(f"Wall time      = {self.wall_seconds:.6f} s")
        return "\n".join(lines)


def _device_name(kind: str, index: int) -> str:
    return kind if index < 0 else f"{kind}:{index}"


def resolve_kernel(kernel: str, items_per_rank: int) -> str:
    """``eager`` or ``fused``; ``auto`` picks by the per-rank share (see :data:`FUSED_FROM_ITEMS`)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; choose one of {KERNELS}")
    if kernel == "auto":
        return "fused" if items_per_rank >= FUSED_FROM_ITEMS else "eager"
    return kernel


def default_threads(kernel: str, local_world_size: int) -> int:
    """CPU threads per rank. The eager kernel's chunk-sized, memory-bound ops gain nothing from intra-op
    threads (measured: one thread is as fast as two) and each op becomes a thread barrier that stalls
    badly on a busy machine, so it runs on one thread; the fused loop splits one large chunk over the
    node's cores shared among its ranks."""
    if kernel == "eager":
        return 1
    return threads_per_rank(local_world_size)


def run_pi(
    world: World,
    method: str,
    n: int,
    *,
    seed: int = 0,
    chunk: int | None = None,
    threads: int | None = None,
    kernel: str = "auto",
    progress: bool = False,
) -> PiReport:
    """Compute π with ``method`` over ``n`` items split across the world's ranks; every rank must call it.

    ``kernel`` is the same on every rank (``auto`` decides from the largest share, identical everywhere).
    A fused kernel is compiled before the barrier, so compilation never lands in the measured time.
    ``progress``: rank 0 says on stderr when it compiles the kernel and, every 10 s, how long the
    computation has run (a 10¹¹-sample run is otherwise silent for minutes).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    check_work(n)
    kernel = resolve_kernel(kernel, -(-n // world.world_size))
    device = world.device
    if device.type == "cpu":
        torch.set_num_threads(threads or default_threads(kernel, world.local_world_size))
    hits_fn, midpoint_fn = (
        (montecarlo_hits_fused, midpoint_partial_fused)
        if kernel == "fused"
        else (montecarlo_hits, midpoint_partial)
    )
    talk = progress and world.rank == 0
    if kernel == "fused":  # compile (or load it cached) outside the timing
        _say(talk, "meshwise pi: preparing the fused kernel (compiled on first use, ~30 s; cached after) …")
        ready = time.perf_counter()
        if method == "montecarlo":
            hits_fn(0, 1, seed, device=device, chunk=chunk)
        else:
            midpoint_fn(0, 1, 1, device=device, chunk=chunk)
        _say(talk, f"meshwise pi: kernel ready in {time.perf_counter() - ready:.1f} s")
    comm = world.comm
    start, count = split_range(n, world.world_size, world.rank)
    comm.barrier()
    t0 = time.perf_counter()
    what = "samples" if method == "montecarlo" else "bins"
    with heartbeat(f"meshwise pi: computing {n} {what} on {world.world_size} ranks", enabled=talk):
        if method == "montecarlo":
            hits = hits_fn(start, count, seed, device=device, chunk=chunk)
            partial = 4.0 * hits / n
            combined = torch.tensor([hits], dtype=torch.int64, device=device)
        else:
            hits = 0
            partial = midpoint_fn(start, count, n, device=device, chunk=chunk)
            combined = torch.tensor([partial], dtype=torch.float64, device=device)
    t1 = time.perf_counter()
    comm.all_reduce(combined, ReduceOp.SUM)
    total = combined.item()
    t2 = time.perf_counter()

    index = -1 if device.index is None else device.index
    counts = torch.tensor([count, hits, world.local_rank, world.local_world_size, index], dtype=torch.int64)
    floats = torch.tensor([partial, t1 - t0, t2 - t0], dtype=torch.float64)
    all_counts = torch.empty(5 * world.world_size, dtype=torch.int64, device=device)
    all_floats = torch.empty(3 * world.world_size, dtype=torch.float64, device=device)
    comm.all_gather(all_counts, counts.to(device))
    comm.all_gather(all_floats, floats.to(device))
    ints, reals = all_counts.view(-1, 5).tolist(), all_floats.view(-1, 3).tolist()
    ranks = tuple(
        RankStats(r, lr, lws, _device_name(device.type, idx), items, h, part, comp, tot)
        for r, ((items, h, lr, lws, idx), (part, comp, tot)) in enumerate(zip(ints, reals, strict=True))
    )
    wall = max(r.total_seconds for r in ranks)
    if method == "montecarlo":
        estimate, stderr = estimate_from_hits(int(total), n)
        return PiReport(method, n, world.world_size, estimate, int(total), stderr, wall, ranks)
    return PiReport(method, n, world.world_size, float(total), None, None, wall, ranks)


def _say(enabled: bool, line: str) -> None:
    if enabled:
        print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class PiJob:
    """Everything a rank needs for ``repeat`` π runs, checked by :meth:`validate` before any rank starts.

    ``threads`` None is :func:`default_threads`; ``warmup`` first runs a small untimed job so one-time
    costs (first kernel calls, the communicator's first collective) stay out of the first measurement.
    ``timeout`` bounds the whole job; each wait gets :func:`~meshwise.runtime.timeouts.wait_timeout`.
    """

    method: str
    n: int
    seed: int = 0
    backend: str = "auto"
    device: str | None = None
    chunk: int | None = None
    repeat: int = 1
    kernel: str = "auto"
    threads: int | None = None
    warmup: bool = False
    timeout: float = 3600.0
    progress: bool = False  # rank 0 reports the kernel compile and a heartbeat on stderr

    def validate(self) -> PiJob:
        """Raise ValueError saying which option to change; return self."""
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        check_work(self.n)
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"--seed must be in 0 .. 2**64-1, got {self.seed}")
        check_backend(self.backend, what="--backend")
        if self.backend == "mpi":
            check_mpi_launch(f"pi {self.method} 1e6")
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"--chunk must be a positive number of items, got {self.chunk}")
        if self.kernel not in KERNELS:
            raise ValueError(f"--kernel {self.kernel!r} is unknown; choose one of {', '.join(KERNELS)}")
        if self.repeat < 1:
            raise ValueError(f"repeat must be at least 1, got {self.repeat}")
        if self.timeout <= 0:
            raise ValueError(f"--timeout must be positive seconds, got {self.timeout}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but CUDA is not available here; use --device cpu")
        return self


def pi_rank_main(job: PiJob) -> list[PiReport]:
    """Entry point of one rank: join the job, run ``job.repeat`` times, leave; returns the reports."""
    world = init(job.backend, device=job.device, timeout=wait_timeout(job.timeout))
    try:
        kernel = resolve_kernel(job.kernel, -(-job.n // world.world_size))
        options = {"seed": job.seed, "chunk": job.chunk, "threads": job.threads, "kernel": kernel}
        if job.warmup:
            run_pi(world, job.method, min(job.n, _WARMUP_ITEMS), **options)
        return [run_pi(world, job.method, job.n, **options, progress=job.progress) for _ in range(job.repeat)]
    finally:
        shutdown()
