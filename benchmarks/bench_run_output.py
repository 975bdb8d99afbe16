"""What forwarding rank output costs: ``meshwise run -n 2`` of a script whose ranks print as fast as they can.

Each rank prints ``--lines`` short lines with ``print`` (two writes each under ``python -u``). Launchers
are timed side by side, alternating within each of ``--rounds`` rounds, once with ``--lines`` lines and
once with none; the difference of the medians is the time spent on output, reported as lines per second
(both ranks' lines). Launchers:

- ``meshwise run``: lines through the shared datagram channel, prefixed ``[rank N]``, in write order;
- ``torchrun``: the workers inherit the launcher's stdout (no prefix, no forwarding at all): the floor;
- ``meshwise run (SRC)`` with ``--compare-src SRC``: another checkout's launcher (e.g. one that forwarded
  per-rank pipes), run with ``PYTHONPATH=SRC``.

Output goes to a pipe that this script drains, as in a CI log or ``| tee``.

    python benchmarks/bench_run_output.py --lines 20000 --rounds 3 --json benchmarks/results/run_output.json
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

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "import sys\nfor i in range(int(sys.argv[1])):\n    print('a line of rank output', i)\n"


def _launchers(compare_src: str | None) -> dict[str, tuple[list[str], str]]:
    """name -> (command prefix before the script, PYTHONPATH)."""
    ours = str(ROOT / "src")
    found = {
        "meshwise run": ([sys.executable, "-m", "meshwise", "run", "-n", "2"], ours),
        "torchrun": ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"], ours),
    }
    if compare_src:
        found[f"meshwise run ({compare_src})"] = (found["meshwise run"][0], compare_src)
    return found


def _time(prefix: list[str], pythonpath: str, script: str, lines: int) -> float:
    env = {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run([*prefix, script, str(lines)], env=env, capture_output=True, timeout=600)
    seconds = time.perf_counter() - start
    forwarded = done.stdout.count(b"a line of rank output")
    if done.returncode != 0 or forwarded != 2 * lines:
        lost = f"{forwarded}/{2 * lines} lines"
        raise RuntimeError(f"{prefix[2:]} failed or lost lines ({lost}): {done.stderr[-500:]!r}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=20000, help="lines each rank prints (default 20000)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--compare-src", metavar="SRC", help="also time the meshwise under this src/ folder")
    parser.add_argument("--json", metavar="FILE", help="write the table as JSON")
    args = parser.parse_args()
    launchers = _launchers(args.compare_src)
    times: dict[str, dict[int, list[float]]] = {name: {0: [], args.lines: []} for name in launchers}
    with tempfile.TemporaryDirectory() as directory:
        script = str(Path(directory) / "printer.py")
        Path(script).write_text(SCRIPT)
        for _ in range(args.rounds):
            for name, (prefix, pythonpath) in launchers.items():
                for lines in (0, args.lines):
                    times[name][lines].append(_time(prefix, pythonpath, script, lines))
    rows = []
    print(f"{'launcher':<40} {'empty s':>8} {'full s':>8} {'lines/s':>10}")
    for name, measured in times.items():
        empty, full = statistics.median(measured[0]), statistics.median(measured[args.lines])
        rate = 2 * args.lines / max(full - empty, 1e-9)
        row = {"launcher": name, "empty_s": empty, "full_s": full, "lines_per_s": rate, "runs": measured}
        rows.append(row)
        print(f"{name:<40} {empty:8.2f} {full:8.2f} {rate:10.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"lines_per_rank": args.lines, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
