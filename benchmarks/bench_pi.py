"""Throughput of the π kernels on one device: Monte Carlo samples/s and midpoint bins/s.

Both kernels are measured: ``eager`` (torch ops, memory-bound) and ``fused`` (one compiled loop). On CPU
it runs on ``--threads`` threads (default 1, i.e. per core, the figure RESULTS.md reports); on CUDA it
reports the device rate. Each configuration is timed ``--repeat`` times after a
warm-up and the best and median rates are printed as a table, then as JSON (``--json FILE`` also writes it).

    python benchmarks/bench_pi.py                       # CPU, 1 thread, default sizes
    python benchmarks/bench_pi.py --device cuda -n 1e11 # one GPU (fused = torch.compile → Triton)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from meshwise.cli.pi import parse_count
from meshwise.workloads.pi import default_chunk, midpoint_partial, montecarlo_hits
from meshwise.workloads.pi_fused import default_fused_chunk, midpoint_partial_fused, montecarlo_hits_fused


def _time(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()  # both kernels return a Python number, which synchronises the device
    return time.perf_counter() - start


KERNELS = {
    ("montecarlo", "eager"): lambda n, device, chunk: montecarlo_hits(0, n, 1, device=device, chunk=chunk),
    ("montecarlo", "fused"): lambda n, device, chunk: montecarlo_hits_fused(
        0, n, 1, device=device, chunk=chunk
    ),
    ("midpoint", "eager"): lambda n, device, chunk: midpoint_partial(0, n, n, device=device, chunk=chunk),
    ("midpoint", "fused"): lambda n, device, chunk: midpoint_partial_fused(
        0, n, n, device=device, chunk=chunk
    ),
}


def measure(method: str, kernel: str, n: int, chunk: int, device: torch.device, repeat: int) -> dict:
    """Best and median rate of one kernel; a short untimed call first compiles/warms it."""
    run = KERNELS[method, kernel]
    _time(lambda: run(min(n, chunk), device, chunk), device)
    seconds = [_time(lambda: run(n, device, chunk), device) for _ in range(repeat)]
    return {
        "method": method,
        "kernel": kernel,
        "device": str(device),
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "items": n,
        "chunk": chunk,
        "best_per_s": n / min(seconds),
        "median_per_s": n / statistics.median(seconds),
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1 = per-core figure)")
    parser.add_argument(
        "-n", "--items", default=None, help="samples/bins per timing (default 1e8 CPU, 1e11 GPU)"
    )
    parser.add_argument("--kernels", default="eager,fused", help="eager and/or fused (comma-separated)")
    parser.add_argument("--chunks", default=None, help="comma-separated chunk sizes (default: per kernel)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available here; use --device cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    n = parse_count(args.items) if args.items else (100_000_000 if device.type == "cpu" else 10**11)
    configs = []
    for kernel in args.kernels.split(","):
        if kernel not in ("eager", "fused"):
            parser.error(f"--kernels takes eager and/or fused, got {kernel!r}")
        default = default_chunk(device) if kernel == "eager" else default_fused_chunk(device)
        chunks = [int(c) for c in args.chunks.split(",")] if args.chunks else [default]
        configs += [(kernel, chunk) for chunk in chunks]
    results = [
        measure(m, k, n, c, device, args.repeat) for m in ("montecarlo", "midpoint") for k, c in configs
    ]
    where = (
        f"{device} ({args.threads} thread{'s' * (args.threads > 1)})" if device.type == "cpu" else str(device)
    )
    print(f"pi kernels on {where}, {n} items per timing, {args.repeat} timings")
    print(f"{'method':<11} {'kernel':<6} {'chunk':>11} {'best items/s':>14} {'median items/s':>15}")
    for r in results:
        row = f"{r['method']:<11} {r['kernel']:<6} {r['chunk']:>11} {r['best_per_s']:>14.4e}"
        print(f"{row} {r['median_per_s']:>15.4e}")
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
