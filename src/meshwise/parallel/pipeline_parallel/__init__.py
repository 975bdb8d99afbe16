"""Pipeline parallelism: cut a model (by its plan) into chunks, schedule micro-batches through them, run
the schedule (its modules: docs/architecture.md; its design: docs/pipeline.md)."""

from meshwise.parallel.pipeline_bubble import theoretical_bubble
from meshwise.parallel.pipeline_parallel.executor import Event, PipelineFailure
from meshwise.parallel.pipeline_parallel.partition import chunk_parameters, partition
from meshwise.parallel.pipeline_parallel.schedules import SCHEDULES, Instruction, Op, Schedule, build_schedule
from meshwise.parallel.pipeline_parallel.simulator import ScheduleError, simulate

__all__ = [
    "SCHEDULES",
    "Event",
    "Instruction",
    "Op",
    "PipelineFailure",
    "Schedule",
    "ScheduleError",
    "build_schedule",
    "chunk_parameters",
    "partition",
    "simulate",
    "theoretical_bubble",
]
