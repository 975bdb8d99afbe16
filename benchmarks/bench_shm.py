"""shm vs gloo, side by side in one run: busbw and latency of the collectives on one host.

For every world size in ``--np`` the ranks build both communicators over the same processes and time
each (collective, size) on gloo and on shm with identical buffers: ``--warmup`` untimed calls, then
``--rounds`` rounds that alternate the two backends, each a gloo barrier and enough back-to-back calls to
fill about ``--budget`` / ``--rounds`` seconds (the same count on every rank). Every round starts with
untimed calls of its backend (a tenth of its count): right after the other backend's round, calls ran up
to 20 % slower (4 ranks on 2 cores, paired probe) while the ranks' scheduling settled. A round's time
of one call is the slowest rank's mean, as in nccl-tests; the reported time is the median over the
rounds, so a burst of load from elsewhere on a shared machine moves one round, not the result;
``--repeat k`` runs the whole sweep k times (world sizes interleaved, ``--pause`` seconds apart) and
reports the median run per row, against slow spells that last longer than a row. busbw follows nccl-tests
(:mod:`meshwise.bench.busbw`). One extra call per row compares the two backends' results (``wrong``).

The memcpy-bound limit of all_reduce: every rank must at least copy its buffer into shared memory and
copy the result out, i.e. two copies of the S-byte buffer per rank, done by ``min(n, cores)`` cores in
parallel. With C the measured single-core copy bandwidth (the faster of numpy's memcpy and torch's
``copy_``, see :func:`copy_bandwidth`) (bytes copied per second, buffers larger than
the caches), one all_reduce takes at least ``2·S·n / (C·min(n, cores))`` of core-time spread over n
ranks, so ``busbw_limit = 2(n−1)/n · S / t = (n−1)/n · C · min(1, cores/n)``. C is measured before the
first run and after every run; each run is judged against the larger of the two samples next to it (a
slow spell cannot lower its limit, and a run is not judged by a C measured many minutes away on a machine
whose speed drifts), and ``%limit`` is the median over runs, with the lowest and highest run beside it.
The bound is for data streaming from memory: at sizes where every rank's buffers fit the shared cache, a
run can exceed it.

    python benchmarks/bench_shm.py --np 2,4 --json shm_vs_gloo.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

import meshwise
from meshwise.bench.busbw import bus_factor, layout_for
from meshwise.bench.sizes import parse_size
from meshwise.comm.api import Communicator
from meshwise.comm.shm import ShmCommunicator
from meshwise.runtime.spawn import spawn

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
DEFAULT_SIZES = "4K,64K,1M,4M,16M"


def _buffers(collective: str, nbytes: int, n: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) float32 buffers of one row; small integers, so every backend's result is exact."""
    layout = layout_for(collective, nbytes, n, 4)
    count = layout.count
    source_len = count if collective != "reduce_scatter" else count * n
    source = ((torch.arange(source_len) + rank) % 7).float()
    if collective in ("all_gather", "reduce_scatter"):
        return source, torch.empty(count * n if collective == "all_gather" else count)
    return source, torch.empty(count * n if collective == "all_to_all" else count)


def _call(comm: Communicator, collective: str, source: torch.Tensor, out: torch.Tensor) -> None:
    if collective == "all_reduce":
        comm.all_reduce(source, output=out)
    elif collective == "all_gather":
        comm.all_gather(out, source)
    elif collective == "reduce_scatter":
        comm.reduce_scatter(out, source)
    elif collective == "broadcast":
        comm.broadcast(source, root=0)
    else:
        comm.all_to_all(out, source)


def _rank_main(
    sizes: list[int], collectives: list[str], warmup: int, budget: float, rounds: int, threads: int
) -> list:
    torch.set_num_threads(threads)
    world = meshwise.init("gloo", timeout=120)
    gloo = world.comm
    shm = ShmCommunicator.from_process_group(None, timeout=120)
    n, rank = world.world_size, world.rank
    rows = []
    for done, collective in enumerate(collectives, 1):
        for nbytes in sizes:
            source, out = _buffers(collective, nbytes, n, rank)
            if collective == "all_to_all":
                source = torch.cat([source] * n)
            backends = {"gloo": gloo, "shm": shm}
            iters, per_round = {}, {}
            for name, comm in backends.items():
                for _ in range(warmup):
                    _call(comm, collective, source, out)
                gloo.barrier()
                start = time.perf_counter()
                _call(comm, collective, source, out)
                probe = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                gloo.all_reduce(probe, op="max")  # same iteration count on every rank
                iters[name] = max(3, min(1000, int(budget / rounds / max(probe.item(), 1e-6))))
                per_round[name] = []
            for _ in range(rounds):
                for name, comm in backends.items():
                    for _ in range(1 + iters[name] // 10):  # settle after the other backend's round
                        _call(comm, collective, source, out)
                    gloo.barrier()
                    start = time.perf_counter()
                    for _ in range(iters[name]):
                        _call(comm, collective, source, out)
                    elapsed = torch.tensor([(time.perf_counter() - start) / iters[name]], dtype=torch.float64)
                    gloo.all_reduce(elapsed, op="max")
                    per_round[name].append(elapsed.item())
            seconds = {name: statistics.median(times) for name, times in per_round.items()}
            results = []
            for comm in (gloo, shm):
                data = source.clone()
                _call(comm, collective, data, out)
                results.append((data if collective == "broadcast" else out).clone())
            wrong = torch.tensor([int((results[0] != results[1]).sum())], dtype=torch.int64)
            gloo.all_reduce(wrong)
            rows.append((collective, layout_for(collective, nbytes, n, 4).nbytes, seconds, int(wrong.item())))
        if rank == 0:  # progress: a full sweep takes a quarter of an hour
            print(f"#   {n} ranks: {collective} done ({done}/{len(collectives)})", file=sys.stderr)
    shm.close()
    meshwise.shutdown()
    return rows


def _median_of_runs(runs: list[list]) -> list:
    """Rows of several whole runs merged: per row and backend the median time, and any wrong result."""
    merged = []
    for same in zip(*runs, strict=True):
        collective, nbytes = same[0][0], same[0][1]
        seconds = {k: statistics.median(row[2][k] for row in same) for k in same[0][2]}
        merged.append((collective, nbytes, seconds, sum(row[3] for row in same)))
    return merged


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Single-core copy bandwidth (bytes copied per second) between buffers far larger than the caches:
    the faster of numpy's ``copyto`` (glibc memcpy, what the shm data path uses) and torch's one-thread
    ``copy_``, so the limit is the host's, not one library's (copy_ ran at about 60 % of copyto here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    copies = (lambda: dst.copy_(src), lambda: np.copyto(dst.numpy(), src.numpy()))
    best = float("inf")
    for _ in range(repeats):
        for copy in copies:
            start = time.perf_counter()
            copy()
            best = min(best, time.perf_counter() - start)
    torch.set_num_threads(threads)
    return nbytes / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", default="2,4", help="world sizes, comma-separated (default 2,4)")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"bytes per row (default {DEFAULT_SIZES})")
    parser.add_argument("--collectives", default=",".join(COLLECTIVES))
    parser.add_argument("-w", "--warmup", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of timed calls per cell")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; the median counts")
    parser.add_argument("--repeat", type=int, default=1, help="whole runs; the median per row counts")
    parser.add_argument("--pause", type=float, default=0.0, help="seconds to wait between runs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    collectives = args.collectives.split(",")
    unknown = sorted(set(collectives) - set(COLLECTIVES))
    if unknown:
        parser.error(f"unknown collectives {unknown}; choose from {', '.join(COLLECTIVES)}")
    cores = len(os.sched_getaffinity(0))
    worlds = [int(x) for x in args.np.split(",")]
    copies = [copy_bandwidth()]
    runs: dict[int, list[list]] = {n: [] for n in worlds}
    for index in range(args.repeat):  # world sizes interleaved, so a slow spell hits each of them once
        if index and args.pause:
            time.sleep(args.pause)
        for n in worlds:
            minutes = len(collectives) * len(sizes) * 2 * args.budget / 60  # timed calls alone
            print(
                f"# run {index + 1}/{args.repeat}, {n} ranks: {len(collectives)} collectives x {len(sizes)} "
                f"sizes, at least {minutes:.1f} min …",
                file=sys.stderr,
                flush=True,
            )
            job = (sizes, collectives, args.warmup, args.budget, args.rounds, args.threads)
            runs[n].append(spawn(_rank_main, n, args=job, timeout=3600)[0])
        copies.append(copy_bandwidth())
    # each run is judged against the higher C measured next to it: a slow spell cannot lower its limit
    run_copy = [max(pair) for pair in itertools.pairwise(copies)]
    results = {n: _median_of_runs(r) for n, r in runs.items()}
    print(
        f"single-core copy bandwidth C = {min(copies) / 1e9:.2f}-{max(copies) / 1e9:.2f} GB/s over "
        f"{len(copies)} samples (before the first run and after each); {cores} cores"
    )
    print("all_reduce memcpy-bound limit: busbw <= (n-1)/n * C * min(1, cores/n), C the higher sample")
    print("next to each run; %limit is the median over runs (range: lowest-highest run)")
    header = (
        f"{'np':>3} {'collective':<15}{'size':>10} {'gloo us':>10} {'gloo GB/s':>10} "
        f"{'shm us':>10} {'shm GB/s':>9} {'speedup':>8} {'%limit':>7} {'range':>9} {'wrong':>6}"
    )
    records = []
    for n, rows in results.items():
        print(header)
        for index, (collective, nbytes, seconds, wrong) in enumerate(rows):
            factor = bus_factor(collective, n)
            bus = {k: nbytes / t * factor for k, t in seconds.items()}
            limits = shares = None
            share = spread = ""
            if collective == "all_reduce":
                limits = [(n - 1) / n * c * min(1.0, cores / n) for c in run_copy]
                shares = [
                    100 * nbytes / run[index][2]["shm"] * factor / limit
                    for run, limit in zip(runs[n], limits, strict=True)
                ]
                share = f"{statistics.median(shares):6.0f}%"
                spread = f"{min(shares):.0f}-{max(shares):.0f}"
            print(
                f"{n:>3} {collective:<15}{nbytes:>10} "
                f"{seconds['gloo'] * 1e6:>10.1f} {bus['gloo'] / 1e9:>10.2f} "
                f"{seconds['shm'] * 1e6:>10.1f} {bus['shm'] / 1e9:>9.2f} "
                f"{seconds['gloo'] / seconds['shm']:>7.1f}x {share:>7} {spread:>9} {wrong:>6}"
            )
            records.append(
                {
                    "world_size": n,
                    "collective": collective,
                    "bytes": nbytes,
                    "gloo_seconds": seconds["gloo"],
                    "shm_seconds": seconds["shm"],
                    "gloo_busbw": bus["gloo"],
                    "shm_busbw": bus["shm"],
                    "speedup": seconds["gloo"] / seconds["shm"],
                    "wrong": wrong,
                    "run_shm_seconds": [run[index][2]["shm"] for run in runs[n]],
                    "run_gloo_seconds": [run[index][2]["gloo"] for run in runs[n]],
                    "memcpy_limit_busbw_runs": limits,
                    "percent_of_limit_runs": shares,
                    "percent_of_limit": statistics.median(shares) if shares else None,
                }
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "copy_bandwidth_samples": copies,
                    "run_copy_bandwidth": run_copy,
                    "cores": cores,
                    "threads": args.threads,
                    "rounds": args.rounds,
                    "repeat": args.repeat,
                    "pause": args.pause,
                    "argv": sys.argv,
                    "rows": records,
                },
                f,
                indent=2,
            )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
