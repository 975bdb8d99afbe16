"""Uneven all_to_all: meshwise's ``all_to_all_single`` on shm against gloo's own, same splits, side by side.

For every world size in ``--np`` the ranks build a gloo process group and a shm communicator over the
same processes. Per (pattern, size) both run torch's ``all_to_all_single`` semantics with identical
buffers and split sizes: gloo through ``torch.distributed.all_to_all_single`` directly (what a torch user
calls), meshwise through ``comm.all_to_all_single`` on shm. Patterns: ``balanced`` (nccl-tests' even
alltoall) and ``skewed`` (rank 0 a hot expert exchanging ``--skew`` times the rows of any other pair, both
ways; :meth:`meshwise.bench.busbw.Layout.split`). The size is the largest rank's send buffer.

Beside them, ``floor`` times the copies any shared-memory exchange must make, on every rank at once and
without synchronisation: the bytes for the peers copied once into a staging buffer and once out of one,
the rank's own block once (memcpy through numpy, as the shm backend copies). ``shm/floor`` says how close
the transport runs to that ceiling; the rest is synchronisation and scheduling.

Timing as nccl-tests: ``--rounds`` rounds alternate the backends; each is a barrier, then enough calls
back to back to fill ``--budget``/``--rounds`` seconds (same count on every rank), divided; a round's
figure is the slowest rank's; the reported time is the median over rounds. One extra call per row
compares the two results element for element (``wrong``). More ranks than cores (4 ranks on a 2-core
host) measure contention as much as the transport: the table says how many cores there were.

    python benchmarks/bench_alltoall.py --np 2,4 --json benchmarks/results/c30_alltoall.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

import meshwise
from meshwise.bench.busbw import layout_for
from meshwise.bench.sizes import parse_size
from meshwise.comm.shm import ShmCommunicator
from meshwise.runtime.spawn import spawn

DEFAULT_SIZES = "64K,1M,4M,16M"


def _splits(pattern: str, nbytes: int, n: int, rank: int, skew: int) -> list[int]:
    """Rows (float32 elements) this rank sends each rank; symmetric, so also what it receives."""
    layout = layout_for("all_to_all", nbytes, n, 4, skew if pattern == "skewed" else 1)
    return [layout.split(rank, j) for j in range(n)]


def _copy_floor(out: np.ndarray, source: np.ndarray, stage: np.ndarray, own: slice) -> None:
    """The copies of an exchange through shared memory without its synchronisation (module docstring):
    the peers' share of ``source`` into ``stage`` and back out into ``out``, the own block directly."""
    before, after = source[: own.start], source[own.stop :]
    np.copyto(stage[: before.size], before)
    np.copyto(stage[before.size :], after)
    np.copyto(out[: own.start], stage[: before.size])
    np.copyto(out[own.stop :], stage[before.size :])
    np.copyto(out[own], source[own])


def _rank_main(sizes: list[int], skew: int, warmup: int, budget: float, rounds: int) -> list:
    torch.set_num_threads(1)
    world = meshwise.init("gloo", timeout=300)
    gloo = world.comm
    shm = ShmCommunicator.from_process_group(None, timeout=300)
    n, rank = world.world_size, world.rank
    rows = []
    for pattern in ("balanced", "skewed"):
        for nbytes in sizes:
            splits = _splits(pattern, nbytes, n, rank, skew)
            source = ((torch.arange(sum(splits)) + 3 * rank) % 11).float()
            outs = {name: torch.empty(sum(splits)) for name in ("gloo", "shm", "floor")}
            own = slice(sum(splits[:rank]), sum(splits[: rank + 1]))
            stage = np.empty(sum(splits) - splits[rank], dtype=np.float32)
            calls = {
                "gloo": partial(dist.all_to_all_single, outs["gloo"], source, splits, splits),
                "shm": partial(shm.all_to_all_single, outs["shm"], source, splits, splits),
                "floor": partial(_copy_floor, outs["floor"].numpy(), source.numpy(), stage, own),
            }
            iters, per_round = {}, {name: [] for name in calls}
            for name, call in calls.items():
                for _ in range(warmup):
                    call()
                gloo.barrier()
                start = time.perf_counter()
                call()
                probe = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                gloo.all_reduce(probe, op="max")  # same iteration count on every rank
                iters[name] = max(3, min(2000, int(budget / rounds / max(probe.item(), 1e-6))))
            for _ in range(rounds):
                for name, call in calls.items():
                    gloo.barrier()
                    start = time.perf_counter()
                    for _ in range(iters[name]):
                        call()
                    elapsed = torch.tensor([(time.perf_counter() - start) / iters[name]], dtype=torch.float64)
                    gloo.all_reduce(elapsed, op="max")
                    per_round[name].append(elapsed.item())
            wrong = torch.tensor([int((outs["gloo"] != outs["shm"]).sum())], dtype=torch.int64)
            gloo.all_reduce(wrong)
            largest = layout_for("all_to_all", nbytes, n, 4, skew if pattern == "skewed" else 1).nbytes
            seconds = {name: statistics.median(times) for name, times in per_round.items()}
            rows.append((pattern, largest, seconds, int(wrong.item())))
    shm.close()
    meshwise.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", default="2,4", help="world sizes, comma-separated (default 2,4)")
    parser.add_argument(
        "--sizes", default=DEFAULT_SIZES, help=f"largest send buffer per row ({DEFAULT_SIZES})"
    )
    parser.add_argument("--skew", type=int, default=4, help="hot rank's share in the skewed pattern (4)")
    parser.add_argument("-w", "--warmup", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.6, help="seconds of timed calls per cell")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds; the median counts")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args()
    if args.skew < 1:
        parser.error("--skew must be a whole number >= 1")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    cores = len(os.sched_getaffinity(0))
    load = os.getloadavg()
    records = []
    print(f"# {cores} cores; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; skew {args.skew}")
    print(
        f"{'np':>3} {'pattern':<9}{'bytes':>10} {'gloo us':>10} {'shm us':>10} {'floor us':>10} "
        f"{'speedup':>8} {'shm/floor':>9} {'wrong':>6}"
    )
    for n in (int(x) for x in args.np.split(",")):
        print(
            f"# {n} ranks on {cores} cores{' (oversubscribed: contention)' if n > cores else ''}",
            file=sys.stderr,
        )
        job = (sizes, args.skew, args.warmup, args.budget, args.rounds)
        for pattern, nbytes, seconds, wrong in spawn(_rank_main, n, args=job, timeout=3600)[0]:
            speedup = seconds["gloo"] / seconds["shm"]
            print(
                f"{n:>3} {pattern:<9}{nbytes:>10} {seconds['gloo'] * 1e6:>10.1f} "
                f"{seconds['shm'] * 1e6:>10.1f} {seconds['floor'] * 1e6:>10.1f} {speedup:>7.2f}x "
                f"{seconds['shm'] / seconds['floor']:>8.2f}x {wrong:>6}"
            )
            records.append(
                {
                    "world_size": n,
                    "pattern": pattern,
                    "bytes": nbytes,
                    "gloo_seconds": seconds["gloo"],
                    "shm_seconds": seconds["shm"],
                    "floor_seconds": seconds["floor"],
                    "speedup": speedup,
                    "wrong": wrong,
                }
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "cores": cores, "load_before": load, "load_after": os.getloadavg(),
                       "skew": args.skew, "rounds": args.rounds, "rows": records}, f, indent=2)  # fmt: skip
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
