"""Two nodes behind a slow link: hierarchical all_reduce vs flat gloo, the model's predictions, auto's
picks and a DDP step, side by side in one run.

The "nodes" are two Linux network namespaces (``tests/netns.py``) joined by a veth pair whose outgoing
traffic is shaped to ``--rate`` (1 Gbit/s by default, ``tc … tbf``), two ranks in each; the ranks are
started in torchrun's contract (RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR on node 0's
address, GLOO_SOCKET_IFNAME on each node's veth), so the node map comes from GROUP_RANK. Needs root;
``--one-host`` runs the same ranks on loopback with the node split only emulated (GROUP_RANK set, no
shaping: it exercises the code, its figures say nothing about a slow link).

One run, per rank:

1. the two-level communicator is built once (shared memory inside each node, gloo across);
2. its three links are calibrated on their own transports (``meshwise bench --calibrate``'s
   :func:`~meshwise.bench.calibrate.measure_levels`: each level on the collectives it runs, every group of
   a level at once, calls back to back) on a separate sweep (4 KiB … 16 MiB, every 4×), so the
   predictions are of sizes the fit saw only in part. It must reach well past the token bucket of ``tbf``
   (≥ 256 KiB): smaller messages pass at the veth's own speed; the network links' fits carry that
   bucket's credit (``burst``);
3. all_reduce (float32, sum, out of place) is swept over ``--sizes`` with the flat gloo collective and
   with the hierarchical one (the same process group underneath both), ``--repeats`` times, the two
   alternating; busbw = 2(p−1)/p · n / t with t the average over ranks of back-to-back iterations
   (nccl-tests); results are checked element by element;
4. for each size, medians over the repeats: the busbw ratio, the two-level model's prediction of each
   time against the measured one (both the average over ranks of back-to-back calls, the statistic the
   calibration fits; the fastest rank alone can have left the start barrier late and so skipped part of the
   work, by up to half the time on a loaded machine), auto's pick (the model's) against the faster
   measurement;
5. a DDP step of the 8.4M-parameter MLP (benchmarks/bench_ddp.py's model, batch, SGD) with torch DDP on
   gloo, meshwise DataParallel on flat gloo and on the two-level communicator (auto), rounds rotated.

    sudo python benchmarks/bench_multinode.py --json benchmarks/results/h26_multinode.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the namespace fixture
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_ddp's model and round timing

#: acceptance targets of issue 26: busbw ratio hierarchical / flat
TARGET_LARGE, LARGE_FROM = 1.4, 16 << 20
TARGET_SMALL, SMALL_AT = 1.5, 64 << 10
PREDICTION_FACTOR = 1.5  # the model must predict each time within this factor
AUTO_SHARE = 0.9  # auto must pick the faster at this share of sizes
DEFAULT_SIZES = "64K,128K,256K,512K,1M,2M,4M,8M,16M,32M"
CALIBRATION_SIZES = tuple(4096 << (2 * k) for k in range(7))  # 4 KiB … 16 MiB
NODES, PER_NODE = 2, 2


def parse_sizes(text: str) -> tuple[int, ...]:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return tuple(int(t[:-1]) * units[t[-1]] if t[-1] in units else int(t) for t in text.split(","))


# ----------------------------------------------------------------------------------------- one rank
def worker(args: argparse.Namespace) -> None:
    import torch
    from bench_ddp import _medians, _paired_ratios, _replica, _stepper, _time_rounds
    from torch.nn.parallel import DistributedDataParallel

    import meshwise
    from meshwise.bench.busbw import busbw
    from meshwise.bench.calibrate import measure_levels
    from meshwise.bench.runner import SweepConfig, run_sweep
    from meshwise.comm.algorithms.choice import choose_level_split
    from meshwise.comm.algorithms.registry import predict_seconds
    from meshwise.comm.cost import Calibration
    from meshwise.comm.two_level import TwoLevelCommunicator
    from meshwise.parallel import DataParallel

    cpu = torch.device("cpu")
    world = meshwise.init("gloo", device="cpu", timeout=600)
    control = world.comm
    hierarchical = TwoLevelCommunicator.from_process_group(None, timeout=600, policy="hierarchical")
    flat = hierarchical.base
    describe = hierarchical.describe_levels()

    calibration_sweep = SweepConfig(
        "all_reduce", args.calibration_sizes, iters=args.iters, warmup=2, checks=0
    )
    measured_levels = measure_levels(hierarchical.hierarchy, flat, control, calibration_sweep, cpu)
    fits = measured_levels.fits
    calibration = Calibration.builtin().with_levels(measured_levels.levels)
    auto = TwoLevelCommunicator(
        flat, hierarchical.topology, hierarchical.hierarchy, calibration=calibration, policy="auto"
    )

    measured: dict[str, list] = {"flat": [], "hierarchical": []}
    for repeat in range(args.repeats):  # the two variants alternate, first one then the other
        sweep = SweepConfig("all_reduce", args.sizes, iters=args.iters, warmup=2, checks=int(repeat == 0))
        pair = [("flat", flat), ("hierarchical", hierarchical)]
        for name, comm in pair if repeat % 2 == 0 else pair[::-1]:
            measured[name].append(run_sweep(comm, control, sweep, cpu))
    p, local = world.world_size, PER_NODE
    levels = calibration.two_level()
    rows = []
    for i, n in enumerate(row.size for row in measured["flat"][0]):
        flat_rows = [sweep_rows[i].out_of_place for sweep_rows in measured["flat"]]
        hier_rows = [sweep_rows[i] for sweep_rows in measured["hierarchical"]]
        # medians over the repeats of the average over ranks (nccl-tests' statistic) for busbw, and of
        # the fastest rank, kept for the "fastest" ratio; the model is checked against the former
        t_flat = statistics.median(f.time_us for f in flat_rows) * 1e-6
        t_hier = statistics.median(r.out_of_place.time_us for r in hier_rows) * 1e-6
        fastest_flat = statistics.median(f.time_us_min for f in flat_rows) * 1e-6
        fastest_hier = statistics.median(r.out_of_place.time_us_min for r in hier_rows) * 1e-6
        wrong = flat_rows[0].wrong + hier_rows[0].out_of_place.wrong + hier_rows[0].in_place.wrong
        rows.append(
            {
                "bytes": n,
                "fastest_flat_s_per_repeat": [f.time_us_min * 1e-6 for f in flat_rows],
                "fastest_hierarchical_s_per_repeat": [r.out_of_place.time_us_min * 1e-6 for r in hier_rows],
                "flat_s": t_flat,
                "hierarchical_s": t_hier,
                "fastest_flat_s": fastest_flat,
                "fastest_hierarchical_s": fastest_hier,
                "flat_busbw": busbw("all_reduce", n, t_flat, p) if t_flat > 0 else 0.0,
                "hierarchical_busbw": busbw("all_reduce", n, t_hier, p) if t_hier > 0 else 0.0,
                "predicted_flat_s": predict_seconds("all_reduce", "native", n, p, levels.native),
                "predicted_hierarchical_s": predict_seconds(
                    "all_reduce",
                    "hierarchical",
                    n,
                    p,
                    levels.intra,
                    inter=levels.inter,
                    local_size=local,
                    switch=calibration.level_switch(),
                ),
                "auto_pick": choose_level_split("all_reduce", n, p, local, calibration),
                "wrong_elements": wrong,
            }
        )

    # DDP step: torch DDP on gloo vs ours on flat gloo and on the two-level communicator (auto)
    x = torch.randn(args.batch, 1024, generator=torch.Generator().manual_seed(world.rank))
    models = {
        "torch DDP/gloo": DistributedDataParallel(_replica(0, cpu)),
        "meshwise/gloo": DataParallel(_replica(0, cpu), flat),
        "meshwise/shm+gloo": DataParallel(_replica(0, cpu), auto),
    }
    steppers = {name: _stepper(model, 1e-3, x) for name, model in models.items()}
    samples = _time_rounds(steppers, args.rounds, args.steps, 2, control.barrier)
    reference = list(models["torch DDP/gloo"].parameters())
    disagreement = max(
        (a - b).abs().max().item()
        for model in models.values()
        for a, b in zip(model.parameters(), reference, strict=True)
    )
    del models, steppers, reference  # torch's DDP holds the process group: release it before shutdown
    hierarchical.close()
    meshwise.shutdown()
    if world.rank == 0:
        result = {
            "levels": describe,
            "fits": [{"link": f.name, "worst_factor": f.worst_factor, **vars(f.params)} for f in fits],
            "switch_s": measured_levels.switch,
            "all_reduce": rows,
            "ddp": {
                "median_step_s": _medians(samples),
                "ratio_to_torch": _paired_ratios(samples, "torch DDP/gloo"),
                "max_weight_difference": disagreement,
            },
        }
        Path(args.out).write_text(json.dumps(result))


# ----------------------------------------------------------------------------------------- launching
def _rank_env(rank: int, node: int, master: str, port: int, interface: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GLOO_", "NCCL_", "TORCHELASTIC"))}
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank % PER_NODE),
        WORLD_SIZE=str(NODES * PER_NODE),
        LOCAL_WORLD_SIZE=str(PER_NODE),
        GROUP_RANK=str(node),
        GROUP_WORLD_SIZE=str(NODES),
        MASTER_ADDR=master,
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
    )
    if interface is not None:
        env["GLOO_SOCKET_IFNAME"] = interface
    return env


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for rank, proc in enumerate(procs):
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise SystemExit(
                f"rank {rank} did not finish within {timeout:g} s; every rank was killed"
            ) from None
        if code != 0:
            for other in procs:
                other.kill()
            raise SystemExit(f"rank {rank} failed with exit code {code}; every rank was stopped")


def launch(args: argparse.Namespace, out: str) -> str:
    """Start the 4 ranks (2 per node) and wait for them; returns what describes the link."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", out, *_forwarded(args)]
    port = 29400 + os.getpid() % 1000
    if args.one_host:
        procs = [
            subprocess.Popen(argv, env=_rank_env(r, r // PER_NODE, "127.0.0.1", port, None))
            for r in range(NODES * PER_NODE)
        ]
        _wait_all(procs, args.timeout)
        return "one host, node split emulated on loopback (no shaping)"
    from netns import NamespaceCluster, namespaces_unavailable

    reason = namespaces_unavailable()
    if reason is not None:
        raise SystemExit(f"cannot build the two namespaces: {reason}; run as root, or pass --one-host")
    with NamespaceCluster(nodes=NODES, rate=args.rate) as cluster:
        procs = [
            cluster.popen(
                r // PER_NODE,
                argv,
                env=_rank_env(
                    r, r // PER_NODE, cluster.addresses[0], port, cluster.interfaces[r // PER_NODE]
                ),
            )
            for r in range(NODES * PER_NODE)
        ]
        _wait_all(procs, args.timeout)
    return f"2 network namespaces, veth link shaped to {args.rate} each way (tc tbf)"


def _forwarded(args: argparse.Namespace) -> list[str]:
    return [
        "--sizes", ",".join(map(str, args.sizes)), "--iters", str(args.iters), "--rounds", str(args.rounds),
        "--repeats", str(args.repeats),
        "--calibration-sizes", ",".join(map(str, args.calibration_sizes)),
        "--steps", str(args.steps), "--batch", str(args.batch),
    ]  # fmt: skip


# ----------------------------------------------------------------------------------------- report
def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def report(result: dict, link: str, load: str) -> dict:
    rows = result["all_reduce"]
    print(f"# {NODES} nodes x {PER_NODE} ranks; {link}; load: {load}")
    print(f"# levels: {result['levels']}")
    for fit in result["fits"]:
        bandwidth = 1e-9 / fit["beta"] if fit["beta"] else float("inf")
        print(
            f"# fit {fit['link']:<16} alpha {fit['alpha'] * 1e6:8.1f} us  1/beta {bandwidth:8.3f} GB/s  "
            f"burst {fit.get('burst', 0.0) / 1024:6.0f} KiB  worst factor {fit['worst_factor']:.2f}x"
        )
    print(f"# hand-over between the levels: {result['switch_s'] * 1e6:.1f} us (twice per all_reduce)")
    print(
        f"{'size':>8} {'flat GB/s':>10} {'hier GB/s':>10} {'ratio':>6} {'ratio(fastest)':>14} "
        f"{'pred/meas flat':>15} {'pred/meas hier':>15} {'auto':>12} {'faster':>12}"
    )
    ratios, mean_ratios, within, right = {}, {}, [], []
    for row in rows:
        mean_ratios[row["bytes"]] = row["flat_s"] / row["hierarchical_s"]  # = the busbw ratio
        ratios[row["bytes"]] = row["fastest_flat_s"] / row["fastest_hierarchical_s"]
        pf = row["predicted_flat_s"] / row["flat_s"]
        ph = row["predicted_hierarchical_s"] / row["hierarchical_s"]
        within += [max(pf, 1 / pf) <= PREDICTION_FACTOR, max(ph, 1 / ph) <= PREDICTION_FACTOR]
        faster = "hierarchical" if mean_ratios[row["bytes"]] > 1 else "native"
        right.append(row["auto_pick"] == faster)
        print(
            f"{_size(row['bytes']):>8} {row['flat_busbw']:>10.4f} {row['hierarchical_busbw']:>10.4f} "
            f"{mean_ratios[row['bytes']]:>6.2f} {ratios[row['bytes']]:>14.2f} {pf:>15.2f} {ph:>15.2f} "
            f"{row['auto_pick']:>12} {faster:>12}"
        )
    print(
        "# medians over the repeats; busbw from the average over ranks of back-to-back iterations "
        "(nccl-tests), which the model's check and 'faster' use too (the statistic the calibration fits); "
        "ratio(fastest) from the fastest rank"
    )
    large = [r for n, r in ratios.items() if n >= LARGE_FROM]
    verdicts = {
        f"busbw ratio (fastest) >= {TARGET_LARGE} at >= 16 MiB": bool(large) and min(large) >= TARGET_LARGE,
        f"busbw ratio (fastest) >= {TARGET_SMALL} at 64 KiB": ratios.get(SMALL_AT, 0.0) >= TARGET_SMALL,
        f"busbw ratio (mean) >= {TARGET_LARGE} at >= 16 MiB": min(
            (r for n, r in mean_ratios.items() if n >= LARGE_FROM), default=0.0
        )
        >= TARGET_LARGE,
        f"model within {PREDICTION_FACTOR}x at every size": all(within),
        f"model within {PREDICTION_FACTOR}x at >= {AUTO_SHARE:.0%} of (size, variant) points": sum(within)
        >= AUTO_SHARE * len(within),
        f"auto picks the faster at >= {AUTO_SHARE:.0%} of sizes": sum(right) >= AUTO_SHARE * len(right),
        "no wrong elements": all(r["wrong_elements"] == 0 for r in rows),
    }
    for what, ok in verdicts.items():
        print(f"# {'ok    ' if ok else 'MISSED'} {what}")
    print(
        f"# predictions within {PREDICTION_FACTOR}x: {sum(within)}/{len(within)}; "
        f"auto right at {sum(right)}/{len(right)}"
    )
    ddp = result["ddp"]
    print("DDP step, 8x1024 GELU MLP (8.4M params), SGD; median over rounds")
    for name, seconds in ddp["median_step_s"].items():
        print(f"  {name:<20} {seconds * 1e3:9.1f} ms   x{ddp['ratio_to_torch'][name]:.3f} of torch DDP/gloo")
    print(f"  replicas agree after training: max |dw| = {ddp['max_weight_difference']:.2e}")
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES), help="bytes, e.g. 64K,1M"
    )
    parser.add_argument("--iters", type=int, default=8, help="timed iterations per size")
    parser.add_argument(
        "--repeats", type=int, default=3, help="sweeps of each variant, alternating; medians are reported"
    )
    parser.add_argument(
        "--calibration-sizes",
        type=parse_sizes,
        default=CALIBRATION_SIZES,
        help="bytes the levels are calibrated on (default 4K,16K,…,16M)",
    )
    parser.add_argument("--rate", default="1gbit", help="the inter-node link's rate, as tc writes it")
    parser.add_argument("--rounds", type=int, default=5, help="DDP rounds (each config per round)")
    parser.add_argument("--steps", type=int, default=2, help="DDP steps per round")
    parser.add_argument("--batch", type=int, default=64, help="DDP samples per rank per step")
    parser.add_argument("--one-host", action="store_true", help="no namespaces: emulated split, unshaped")
    parser.add_argument("--timeout", type=float, default=1500.0, help="seconds for the whole run")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        load = Path("/proc/loadavg").read_text().split()[:3]
        link = launch(args, out)
        result = json.loads(Path(out).read_text())
    verdicts = report(result, link, " ".join(load))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        sizes = {"sizes": list(args.sizes), "calibration_sizes": list(args.calibration_sizes)}
        record = {"args": {**vars(args), **sizes}, "link": link, "load_before": load}
        Path(args.json).write_text(json.dumps({**record, **result, "verdicts": verdicts}, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
