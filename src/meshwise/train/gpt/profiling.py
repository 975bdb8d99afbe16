"""``train gpt --profile / --trace / --torch-profile``: the step profile of every GPT strategy.

The loop brackets what it does itself (data, optimizer, the strategy's ``forward_backward``); the
:class:`~meshwise.train.step.ParallelStep` refines the inside (forward, backward, a pipeline's
instructions), so each strategy is profiled through the same seam. At the end, collectively: the
pipeline ranks agree on each step's window (its bubble counts from the pipeline's first instruction to its
last), every rank's events go to rank 0 for the one ``--trace`` file, and torch.profiler stops.

``--torch-profile DIR``: the step profile says which part of a step is slow, torch.profiler which
operators (on a GPU, kernels) inside it. Recording every step would cost much time and memory, so it
follows torch's schedule: ``wait`` steps skipped (the first pays for lazy initialisation and the
allocator), ``warmup`` steps traced and thrown away (the profiler's own start-up), then ``active`` steps
written to ``DIR/rank{R}.json``.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from meshwise.comm.api import ReduceOp
from meshwise.comm.mesh import AXES
from meshwise.train.gpt.layer_memory import LayerMemory
from meshwise.train.gpt.moe import expert_exchange
from meshwise.train.gpt.resolve import GPTRun
from meshwise.train.profile import StepProfiler
from meshwise.train.step import ParallelStep
from meshwise.world import World

#: steps recorded when the run is long enough: a few steps show the pattern, more only grow the file
ACTIVE_STEPS = 3


def profile_schedule(steps: int) -> tuple[int, int, int]:
    """(wait, warmup, active) for a run of ``steps`` steps: 1, 1 and up to 3 when there is room; a short
    run gives up waiting first, then warming up, so at least one step is always recorded."""
    wait = 1 if steps >= 3 else 0
    warmup = 1 if steps - wait >= 2 else 0
    return wait, warmup, max(1, min(ACTIVE_STEPS, steps - wait - warmup))


def torch_profiler(directory: str, rank: int, steps: int, device: torch.device) -> profile:
    """torch.profiler on :func:`profile_schedule`'s steps of ``steps``, writing ``DIR/rank{R}.json`` when
    they are recorded: the loop starts it before its first step and steps it after each."""
    wait, warmup, active = profile_schedule(steps)
    path = Path(directory) / f"rank{rank}.json"

    def write(finished: profile) -> None:
        path.parent.mkdir(exist_ok=True)
        finished.export_chrome_trace(str(path))

    return profile(
        activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device.type == "cuda" else [])],
        schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=write,
        record_shapes=True,
    )


class GPTProfiling:
    """What the run's profile section asks to be measured of ``runner``'s steps; a no-op when nothing is."""

    def __init__(self, world: World, run: GPTRun, runner: ParallelStep, steps: int) -> None:
        self.world, self.profile, self.runner = world, run.config.profile, runner
        config = self.profile
        self.profiler: StepProfiler | None = None
        if config.profiling:
            # the mesh's own communicators: a --comm-stats view would hide their recorders
            comms = [world.comm, *(world.mesh[axis] for axis in AXES)]
            self.profiler = StepProfiler(comms, synchronize=world.device)
        runner.profiler = self.profiler
        self.memory = LayerMemory(runner.model, run) if config.profiling else None
        self.torch: profile | None = None
        if config.torch_profile is not None and steps > 0:
            self.torch = torch_profiler(config.torch_profile, world.rank, steps, world.device)
        self.torch_running = False  # started at the first step, as the schedule counts from there

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if self.torch is not None and not self.torch_running:
            self.torch.start()
            self.torch_running = True
        timed = self.profiler.step() if self.profiler is not None else nullcontext()
        with timed, self.memory.recording() if self.memory is not None else nullcontext():
            yield
        if self.torch is not None:
            self.torch.step()

    def finish(self) -> dict | None:
        """Collective: rank 0's :meth:`StepProfiler.summary` plus, under ``--pp``, the idle share of the
        pipeline's window averaged over its ranks; writes ``--trace`` on rank 0 and the torch.profiler
        files."""
        if self.torch_running:
            self.torch.stop()
            self.torch_running = False
        if self.profiler is None or not self.profiler.steps:
            return None
        self.profiler.share_windows(self.world.mesh.pp)
        result = self.profiler.summary(self.world.rank, self.world.world_size, self.profile.trace)
        if self.memory is not None:
            result["activation_memory"] = self.memory.gather(self.world)
        if self.runner.exchange_seconds:  # --ep: the experts' all-to-alls
            result |= expert_exchange(self.runner.exchange_seconds, result["total_step_seconds"])
        idle = self.profiler.idle_fractions()
        if idle:  # averaged over the pipeline's ranks, as the timeline measures it
            mean = torch.tensor([statistics.fmean(idle[1:] or idle)], dtype=torch.float64)
            self.world.mesh.pp.all_reduce(mean, ReduceOp.AVG)
            result["pipeline_idle_fraction"] = mean.item()
        return result
