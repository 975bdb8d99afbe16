"""The JSON record of a benchmark: every row, plus what a reader needs to compare two records.

Schema ``meshwise.bench/2`` (one object; ``/1`` kept one set of figures per row)::

    schema, created (UTC ISO 8601), command (argv), launcher, world_size, timing (definition),
    machine  {hostname, platform, processor, cpu_count, gpus [names]},
    versions {meshwise, python, torch, numpy, nccl?, mpi?},
    config   {dtype, op, root, iters, warmup, checks, timing ("loop" | "barrier"), average (-a)},
    runs     [{collective, backend, algorithm, world_size, avg_busbw, wrong, out_of_bounds,
               rows [{size, count, type, redop, root,
                      out_of_place {time_us, algbw, busbw, wrong, out_of_bounds, time_us_min, time_us_max},
                      in_place     {the same}}]}]

Bandwidths are GB/s (10^9 B/s) and times µs, as in nccl-tests. A record written after a failure (a
timeout, a dead rank, Ctrl-C) holds the rows that finished and one more key, ``incomplete``, the reason.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from meshwise.bench.runner import Figures, Row, RunResult

SCHEMA = "meshwise.bench/2"


def machine_info() -> dict[str, Any]:
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else []
    )
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "gpus": gpus,
    }


def versions_info() -> dict[str, str]:
    from meshwise import __version__

    versions = {
        "meshwise": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
    }
    if torch.cuda.is_available():
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    mpi = sys.modules.get("mpi4py.MPI")  # only when the run used MPI: importing it would initialise MPI
    if mpi is not None:
        versions["mpi"] = mpi.Get_library_version().splitlines()[0].strip()
    return versions


@dataclass(frozen=True)
class BenchRecord:
    """A whole ``meshwise bench`` invocation."""

    launcher: str
    world_size: int
    config: dict[str, Any]
    runs: tuple[RunResult, ...]
    timing: str  # how time_us was measured, in words (runner.describe_timing)
    command: tuple[str, ...] = ()
    machine: dict[str, Any] = field(default_factory=machine_info)
    versions: dict[str, str] = field(default_factory=versions_info)
    created: str = field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    )
    schema: str = SCHEMA
    incomplete: str | None = None  # why the run stopped early; None for a complete record


def to_dict(record: BenchRecord) -> dict[str, Any]:
    data = asdict(record)
    data["command"] = list(record.command)
    if record.incomplete is None:
        del data["incomplete"]
    data["runs"] = [
        {
            **{k: v for k, v in asdict(run).items() if k != "rows"},
            "avg_busbw": run.avg_busbw,
            "wrong": run.wrong,
            "out_of_bounds": run.out_of_bounds,
            "rows": [asdict(row) for row in run.rows],
        }
        for run in record.runs
    ]
    return data


def from_dict(data: dict[str, Any]) -> BenchRecord:
    schema = data.get("schema")
    if schema == "meshwise.bench/1":
        raise ValueError(
            "a meshwise.bench/1 record (one set of figures per row) predates the out-of-place and in-place "
            f"figures of {SCHEMA}; run the benchmark again to get them"
        )
    if schema != SCHEMA:
        raise ValueError(f"not a meshwise bench record: schema {schema!r}, expected {SCHEMA!r}")
    runs = tuple(
        RunResult(
            collective=run["collective"],
            backend=run["backend"],
            algorithm=run["algorithm"],
            world_size=run["world_size"],
            rows=tuple(_row(row) for row in run["rows"]),
        )
        for run in data["runs"]
    )
    fields = {k: data[k] for k in ("launcher", "world_size", "config", "machine", "versions", "created")}
    return BenchRecord(
        runs=runs,
        command=tuple(data["command"]),
        timing=data["timing"],
        incomplete=data.get("incomplete"),
        **fields,
    )


def _row(data: dict[str, Any]) -> Row:
    placements = {key: Figures(**data[key]) for key in ("out_of_place", "in_place")}
    return Row(**{**data, **placements})


def write_json(path: str, record: BenchRecord) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(to_dict(record), handle, indent=2)
        handle.write("\n")


def read_json(path: str) -> BenchRecord:
    with open(path, encoding="utf-8") as handle:
        return from_dict(json.load(handle))
