"""What the ``--metrics`` JSON-lines stream costs a training step (issue 30: under 1 %).

Two figures side by side: one ``MetricsStream.write`` of a step record (median of ``--writes``, each
JSON-encoded and flushed to a file as the trainer does), and the median step of a short real
``train gpt`` run (gpt-nano, 1 rank, byte tokens of the stdlib's argparse.py) — their ratio is the share
of a step the stream costs when every step is logged (``--log-every 1``, its most expensive use).

    python benchmarks/bench_metrics_stream.py --json benchmarks/results/u30_metrics_stream.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sysconfig
import tempfile
import time
from contextlib import closing
from pathlib import Path

from meshwise.train.gpt import GPTTrainConfig, run_gpt_training
from meshwise.train.metrics_stream import MetricsStream

RECORD = {
    "step": 123, "loss": 3.14159, "lr": 0.002, "grad_norm": 1.2345, "seconds": 0.1, "tokens": 4096,
    "val_loss": None, "tokens_per_second": 40960.0, "mfu": 0.12,
}  # fmt: skip


def write_seconds(writes: int, directory: Path) -> float:
    """Median seconds of one write, as the trainer makes it (encode, write, flush)."""
    times = []
    with closing(MetricsStream(directory / "m.jsonl")) as stream:
        for _ in range(writes):
            started = time.perf_counter()
            stream.write(RECORD)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def step_seconds(steps: int, directory: Path) -> float:
    """Median step of a short gpt-nano run on one rank (the trainer's own per-step timing)."""
    data = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
    config = GPTTrainConfig.from_flags(
        config="gpt-nano", data=str(data), steps=steps, global_batch=8, seq_len=128, eval_every=steps,
        eval_windows=8, backend="gloo", metrics=str(directory / "run.jsonl"), log_every=1,
    )  # fmt: skip
    result = run_gpt_training(config)
    assert result is not None
    return statistics.median(s.seconds for s in result.history[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writes", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        write = write_seconds(args.writes, Path(scratch))
        step = step_seconds(args.steps, Path(scratch))
    share = write / step
    load = os.getloadavg()[0]
    print(f"{'write (median)':<22}{'step (median)':>16}{'share of a step':>18}{'load':>8}")
    print(f"{1e6 * write:>17.1f} µs{1e3 * step:>13.2f} ms{100 * share:>17.4f} %{load:>8.1f}")
    if args.json:
        record = {
            "write_seconds": write,
            "step_seconds": step,
            "share": share,
            "load_1min": load,
            **vars(args),
        }
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
