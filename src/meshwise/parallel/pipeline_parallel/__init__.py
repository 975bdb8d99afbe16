"""Pipeline parallelism: cut a model (by its plan) into chunks, schedule micro-batches through them, run
the schedule.

- :mod:`.partition` — chunks of a model balanced by parameters (or explicit), the plan's tied pairs;
- :mod:`.builder` — model, plan and pp group to this rank's chunks and executor, sizes checked first;
- :mod:`.schedules` — GPipe, 1F1B, interleaved 1F1B and ZB-H1 as per-rank instruction lists (plain data);
- :mod:`.simulator` — unit-time execution proving a schedule complete, matched and deadlock-free, with its
  bubble and activations in flight;
- :mod:`.executor` — runs a schedule over a Communicator (batched isend/irecv, loss on the last stage,
  tied-gradient sum, dp averaging, failure propagation);
- :mod:`.timeline` — Chrome trace and the classic diagram with measured vs theoretical bubble.
"""

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
