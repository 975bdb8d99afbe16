"""``train gpt --profile / --trace / --torch-profile``: the step profile of every GPT strategy.

The loop brackets what it does itself (data, optimizer, the strategy's ``forward_backward``); the
:class:`~meshwise.train.step.ParallelStep` refines the inside (forward, backward, a pipeline's
instructions), so each strategy is profiled through the same seam. At the end, collectively: the
pipeline ranks agree on each step's window (its bubble counts from the pipeline's first instruction to its
last), every rank's events go to rank 0 for the one ``--trace`` file, and torch.profiler stops.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from contextlib import nullcontext

import torch
from torch.profiler import profile

from meshwise.comm.api import ReduceOp
from meshwise.comm.mesh import AXES
from meshwise.train.gpt.layer_memory import LayerMemory
from meshwise.train.gpt.moe import expert_exchange
from meshwise.train.gpt.resolve import GPTRun
from meshwise.train.profile import StepProfiler
from meshwise.train.step import ParallelStep
from meshwise.train.torch_profile import torch_profiler
from meshwise.world import World


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
