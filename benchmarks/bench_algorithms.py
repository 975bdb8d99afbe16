"""Our collective algorithms against the backend's own (native gloo) collective, size by size.

    python benchmarks/bench_algorithms.py -np 2,4 --collective all_reduce --json results.json
    python benchmarks/bench_algorithms.py -np 2,4 --calibrate calibration.json  # fit links per world size

For each world size, message size (4 KiB … 64 MiB by default) and algorithm it prints the time and the
nccl-tests bus bandwidth (all_reduce: size/time·2(p−1)/p), the ratio of each algorithm to native, what
``auto`` chose, and the cost model's prediction and its error (with the calibration's entry for each
world size, ``Calibration.for_world``). A ``control`` column times the native call a second time: the
ratio of two identical calls in one run is the noise floor, and where ``auto`` keeps the native call its
ratio is to be read against it.

Timing: every call starts from a barrier and is timed alone (the slowest rank's time, as in
nccl-tests), which is what the cost model predicts (back-to-back calls of a tree overlap, rings do not).
The algorithms take turns call by call (``--rounds`` × ``--iters`` turns, each in a new random order),
and a time is the median over all of an algorithm's calls: on a shared machine whose speed changes from
second to second, every algorithm then sees the same mix of fast and slow spells, and the median ignores
the stragglers.
``meshwise bench`` is the full tool; this script is the focused comparison behind benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

import meshwise
from meshwise.comm.algorithms import with_algorithm
from meshwise.comm.algorithms.choice import choose_algorithm
from meshwise.comm.algorithms.registry import predict_seconds
from meshwise.comm.bus_factor import bus_factor
from meshwise.comm.cost import Calibration, CostSample, LinkParams, WorldLinks
from meshwise.comm.cost.fit import fit_link_params
from meshwise.runtime.spawn import spawn

#: a second copy of the native call, timed like the algorithms: what separates two identical calls in one
#: run, i.e. the noise floor against which an ``auto`` that kept native is to be read
CONTROL = "control"

#: the collectives this benchmark times (their bus factors come from meshwise.comm.bus_factor)
COLLECTIVES = ("all_gather", "all_reduce", "broadcast", "reduce_scatter")


def _run_once(comm, collective: str, data: torch.Tensor, out: torch.Tensor) -> None:
    if collective == "all_reduce":
        comm.all_reduce(data)
    elif collective == "all_gather":
        comm.all_gather(out, data[: data.numel() // comm.world_size])
    elif collective == "reduce_scatter":
        comm.reduce_scatter(out[: data.numel() // comm.world_size], data)
    else:
        comm.broadcast(data, 0)


def _worker(
    collective: str, sizes: list[int], algos: list[str], iters: int, rounds: int, cal_path: str | None
):
    world = meshwise.init("gloo", timeout=300)
    # One intra-op thread per core share, as torchrun's OMP_NUM_THREADS=1 default: p ranks each running
    # OpenMP pools as wide as the machine thrash the cores and make every local reduction 100x slower.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world.world_size))
    native = world.comm
    calibration = Calibration.from_option(cal_path)
    comms = {a: with_algorithm(native, a, calibration=calibration) for a in algos}
    comms[CONTROL] = with_algorithm(native, "native")  # the native call again: the noise floor
    timed = [*algos, CONTROL]
    rows = []
    for nbytes in sizes:
        count = max(world.world_size, nbytes // 4)
        count -= count % world.world_size
        data = torch.ones(count)
        out = torch.empty(count)
        n_iter = max(3, min(iters, int(5e7 // max(nbytes, 1))))
        for a in timed:  # warm-up: connections, allocations, plan caches
            for _ in range(2):
                _run_once(comms[a], collective, data, out)
        calls: dict[str, list[float]] = {a: [] for a in timed}
        for turn in range(rounds * n_iter):
            for a in _shuffled(timed, turn):
                native.barrier()
                start = time.perf_counter()
                _run_once(comms[a], collective, data, out)
                calls[a].append(time.perf_counter() - start)
        seconds = {}
        for a, mine in calls.items():
            slowest = torch.tensor(mine, dtype=torch.float64)
            native.all_reduce(slowest, "max")  # call by call, the slowest rank's time
            seconds[a] = float(slowest.median())
        rows.append({"nbytes": count * 4, "seconds": seconds, "iters": n_iter * rounds})
    meshwise.shutdown()
    return rows


def _shuffled(algos: list[str], turn: int) -> list[str]:
    """The order of turn ``turn``, the same on every rank: a fresh permutation per turn, so that no
    algorithm always follows the same neighbour. Over loopback TCP the state one algorithm leaves on the
    connections carries over: measured on 2 ranks, whichever block came right after the one-way tree
    ran its 16 KiB all_reduce 10-20 % slower, even when it was the very same native call."""
    return random.Random(turn).sample(algos, len(algos))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-np", "--nproc", default="2,4", help="comma-separated world sizes (default 2,4)")
    parser.add_argument("--collective", default="all_reduce", choices=COLLECTIVES)
    parser.add_argument("-b", "--min-bytes", type=int, default=4 << 10)
    parser.add_argument("-e", "--max-bytes", type=int, default=64 << 20)
    parser.add_argument("-f", "--factor", type=int, default=4)
    parser.add_argument(
        "--algos", default="ring,rd,rhd,tree,auto", help="compared with native (default %(default)s)"
    )
    parser.add_argument("-n", "--iters", type=int, default=20, help="calls per round at small sizes")
    parser.add_argument(
        "--rounds", type=int, default=8, help="turns = rounds × iters (the median over all calls)"
    )
    parser.add_argument(
        "--calibration", help="calibration file for auto and the predictions (default: built-in)"
    )
    parser.add_argument(
        "--calibrate",
        metavar="PATH",
        help="fit α, β, γ per world size (and jointly) from this sweep; write them to PATH",
    )
    parser.add_argument("--json", help="write all measurements here")
    args = parser.parse_args(argv)
    worlds = [int(x) for x in args.nproc.split(",")]
    algos = ["native", *[a for a in args.algos.split(",") if a and a != "native"]]
    if args.factor < 2 or args.min_bytes <= 0 or args.max_bytes < args.min_bytes or min(worlds) < 1:
        parser.error("need -f >= 2, 0 < -b <= -e and world sizes >= 1")
    sizes, size = [], args.min_bytes
    while size <= args.max_bytes:
        sizes.append(size)
        size *= args.factor
    calibration = Calibration.from_option(args.calibration)
    results = []
    for p in worlds:
        rows = spawn(
            _worker,
            p,
            args=(args.collective, sizes, algos, args.iters, args.rounds, args.calibration),
            timeout=3600,
        )[0]
        for row in rows:
            row["world_size"] = p
            row["auto_choice"] = choose_algorithm(args.collective, row["nbytes"], p, calibration)
        results += rows
        _print_table(args.collective, p, rows, algos)
    if args.calibrate:
        calibration = _calibrate(args.collective, results, algos, args.calibrate)
    _report_model(args.collective, results, algos, calibration)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"collective": args.collective, "argv": sys.argv, "results": results}, fh, indent=1)
        print(f"wrote {args.json}")
    return 0


def _ratio(bw: dict[str, float], algo: str) -> str:
    return f"{bw[algo] / bw['native']:8.2f}" if algo in bw else f"{'-':>8}"


def _print_table(collective: str, p: int, rows: list[dict], algos: list[str]) -> None:
    factor = bus_factor(collective, p)
    print(f"\n{collective} on {p} ranks (gloo): busbw GB/s per algorithm, ratio = algorithm / native")
    head = (
        f"{'size':>9} "
        + " ".join(f"{a:>8}" for a in algos)
        + f" {'auto/nat':>8} {'ctl/nat':>8} {'ring/nat':>8}  auto picks"
    )
    print(head)
    for row in rows:
        bw = {a: row["nbytes"] * factor / t / 1e9 for a, t in row["seconds"].items()}
        print(
            f"{_human(row['nbytes']):>9} "
            + " ".join(f"{bw[a]:8.3f}" for a in algos)
            + f" {_ratio(bw, 'auto')} {_ratio(bw, CONTROL)} {_ratio(bw, 'ring')}  {row['auto_choice']}"
        )


def _fit(collective: str, rows: list[dict], algos: list[str], label: str) -> tuple[LinkParams, LinkParams]:
    """(intra, native) fitted to ``rows``: intra from our algorithms, native from the backend's own."""
    ours = [
        CostSample(collective, a, r["nbytes"], r["world_size"], r["seconds"][a])
        for r in rows
        for a in algos
        if a not in ("native", "auto", "hierarchical", CONTROL)
    ]
    natives = [
        CostSample(collective, "native", r["nbytes"], r["world_size"], r["seconds"]["native"]) for r in rows
    ]
    intra, excess_intra = fit_link_params(ours)  # fit_link_params returns the worst factor minus one
    native, excess_native = fit_link_params(natives)
    print(
        f"{label}: fitted intra {intra} (worst factor {1 + excess_intra:.2f}x);\n"
        f"{label}: fitted native {native} (worst factor {1 + excess_native:.2f}x)"
    )
    return intra, native


def _calibrate(collective: str, results: list[dict], algos: list[str], path: str) -> Calibration:
    """One fit per world size into ``by_world_size`` and a joint fit at top level: oversubscribing the
    cores multiplies α with the rank count, so no single α, β, γ describes every world size."""
    rows = [r for r in results if r["world_size"] > 1]
    intra, native = _fit(collective, rows, algos, "all world sizes")
    calibration = Calibration(intra=intra, inter=intra, native=native)
    for p in sorted({r["world_size"] for r in rows}):
        links = _fit(collective, [r for r in rows if r["world_size"] == p], algos, f"{p} ranks")
        calibration = calibration.with_world(p, WorldLinks(*links))
    print(f"wrote {calibration.save(path)}")
    return calibration


def _report_model(collective: str, results: list[dict], algos: list[str], calibration: Calibration) -> None:
    """Predicted vs measured for every point, priced with the calibration's entry for the point's world
    size; 'within 2x' means 1/2 <= predicted/measured <= 2."""
    factors: dict[int, list[float]] = {}
    for row in results:
        row["predicted"] = {}
        world = calibration.for_world(row["world_size"])
        for a in algos:
            shape = row["auto_choice"] if a == "auto" else a
            link = world.native if shape == "native" else world.intra
            predicted = predict_seconds(collective, shape, row["nbytes"], row["world_size"], link)
            row["predicted"][a] = predicted
            if row["world_size"] > 1 and predicted > 0:
                ratio = max(predicted / row["seconds"][a], row["seconds"][a] / predicted)
                factors.setdefault(row["world_size"], []).append(ratio)
    for p, mine in sorted(factors.items()):
        _print_factors(f"{p} ranks", mine)
    if len(factors) > 1:
        _print_factors("all world sizes", [f for mine in factors.values() for f in mine])


def _print_factors(label: str, factors: list[float]) -> None:
    factors = sorted(factors)
    print(
        f"cost model vs measured ({label}): worst factor {factors[-1]:.2f}, "
        f"median {factors[len(factors) // 2]:.2f}, within 2x: {sum(f <= 2.0 for f in factors)}/{len(factors)}"
    )


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:g} {unit}" if unit == "B" else f"{nbytes:.0f} {unit}"
        nbytes /= 1024
    return str(nbytes)


if __name__ == "__main__":
    raise SystemExit(main())
