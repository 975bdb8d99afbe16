"""Pipeline parallelism: cut a model (by its plan) into chunks, schedule micro-batches through them, run
the schedule (its modules: docs/architecture.md; its design: docs/pipeline.md)."""

from meshwise.parallel.pipeline_bubble import theoretical_bubble
from meshwise.parallel.pipeline_parallel.executor import Event, PipelineExecutor, PipelineFailure, StepResult
from meshwise.parallel.pipeline_parallel.partition import (
    LayerChunk,
    chunk_parameters,
    chunks_of_rank,
    partition,
    tied_parameters,
)
from meshwise.parallel.pipeline_parallel.schedules import SCHEDULES, Instruction, Op, Schedule, build_schedule
from meshwise.parallel.pipeline_parallel.simulator import ScheduleError, simulate

__all__ = [
    "SCHEDULES",
    "Event",
    "Instruction",
    "LayerChunk",
    "Op",
    "PipelineExecutor",
    "PipelineFailure",
    "Schedule",
    "ScheduleError",
    "StepResult",
    "build_schedule",
    "chunk_parameters",
    "chunks_of_rank",
    "partition",
    "simulate",
    "theoretical_bubble",
    "tied_parameters",
]
