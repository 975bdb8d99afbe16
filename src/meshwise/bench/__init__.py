"""Collective benchmarks with nccl-tests semantics (``meshwise bench``).

:mod:`sizes` parses sizes, :mod:`busbw` holds nccl-tests' definitions of S, algbw and busbw,
:mod:`cases` the exact-by-construction inputs and checks, :mod:`runner` the timed sweep,
:mod:`job` what every rank runs, :mod:`report`/:mod:`jsonio`/:mod:`plot` the outputs, and
:mod:`calibrate` the α-β-γ fit that the cost model reads.
"""

from meshwise.bench.busbw import COLLECTIVES, algbw, bus_factor, busbw, layout_for
from meshwise.bench.runner import Row, RunResult, SweepConfig, run_sweep
from meshwise.bench.sizes import parse_size, size_sweep

__all__ = [
    "COLLECTIVES",
    "Row",
    "RunResult",
    "SweepConfig",
    "algbw",
    "bus_factor",
    "busbw",
    "layout_for",
    "parse_size",
    "run_sweep",
    "size_sweep",
]
