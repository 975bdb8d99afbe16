"""How ``meshwise bench`` times: nccl-tests' back-to-back loop (default) and the barrier-per-iteration
mode, and nccl-tests' ``-a`` combination of the ranks' times. Structural checks only (what is called how
often, how figures combine); measured figures live in benchmarks/."""

from __future__ import annotations

import torch

from meshwise.bench.runner import SweepConfig, describe_timing, over_ranks, run_sweep
from meshwise.cli import build_parser
from meshwise.cli.bench import build_job
from meshwise.comm.api import Communicator, CompletedWork


class _OneRank(Communicator):
    """One rank that counts its barriers and all_reduces (the operation under test)."""

    backend = "counting"

    def __init__(self) -> None:
        super().__init__(0, 1, 10.0)
        self.barriers = self.all_reduces = 0

    def _barrier(self):
        self.barriers += 1
        return CompletedWork()

    def _all_reduce(self, tensor, op):
        self.all_reduces += 1
        return CompletedWork()

    def _all_gather(self, outputs, input):
        outputs[0].copy_(input)
        return CompletedWork()

    def _isend(self, *args):
        raise AssertionError("not used by an all_reduce sweep")

    _irecv = _broadcast = _reduce = _reduce_scatter = _all_to_all = _scatter = _gather = _split = _isend


def _sweep(timing: str) -> tuple[_OneRank, list]:
    comm, control = _OneRank(), _OneRank()
    config = SweepConfig("all_reduce", (64, 256), iters=7, warmup=2, checks=0, timing=timing, average=1)
    rows = run_sweep(comm, control, config, torch.device("cpu"))
    return comm, rows


def test_loop_timing_meets_once_per_placement_then_runs_back_to_back():
    comm, rows = _sweep("loop")
    placements = 2 * len(rows)  # out of place and in place per size
    assert comm.barriers == placements  # one barrier, then -n operations back to back
    assert comm.all_reduces == placements * (2 + 7)
    for row in rows:
        for f in row.placements:  # one rank: its average is every combination, fastest and slowest
            assert f.time_us == f.time_us_min == f.time_us_max > 0


def test_barrier_timing_meets_before_every_iteration():
    comm, rows = _sweep("barrier")
    assert comm.barriers == 2 * len(rows) * 7
    for f in (f for row in rows for f in row.placements):
        assert f.time_us_min <= f.time_us <= f.time_us_max


def test_ranks_times_combine_as_nccl_tests_dash_a():
    times = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 0.0]])  # 3 ranks × 2 iterations
    assert over_ranks(times, 0).tolist() == [1.0, 2.0]  # rank 0
    assert over_ranks(times, 1).tolist() == [3.0, 2.0]  # average
    assert over_ranks(times, 2).tolist() == [1.0, 0.0]  # minimum
    assert over_ranks(times, 3).tolist() == [5.0, 4.0]  # maximum


def test_options_choose_the_mode_and_its_default_average():
    def sweep(*argv: str) -> SweepConfig:
        return build_job(build_parser("bench").parse_args(["bench", "all_reduce", *argv]))[0].sweep

    assert (sweep().timing, sweep().average) == ("loop", 1)  # nccl-tests' default
    assert (sweep("--timing", "barrier").timing, sweep("--timing", "barrier").average) == ("barrier", 3)
    assert sweep("-a", "2").average == 2 and sweep("--timing", "barrier", "-a", "0").average == 0
    assert (
        describe_timing(sweep("-n", "9")) == "time = 9 operations back to back / 9; average over ranks (-a 1)"
    )
    assert "a barrier before each iteration" in describe_timing(sweep("--timing", "barrier"))
