"""``--torch-profile DIR``: torch.profiler's operator-level view of a few steps, one Chrome trace per rank.

The step profile (:mod:`meshwise.train.profile`) says which part of a step is slow; torch.profiler says
which operators — and on a GPU which kernels — inside it. Recording every step would cost much time and
memory, so it follows torch's schedule: ``wait`` steps skipped (the first step pays for lazy
initialisation and the allocator), ``warmup`` steps traced and thrown away (the profiler's own start-up),
then ``active`` steps recorded and written to ``DIR/rank{R}.json`` (open it in ui.perfetto.dev).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

#: steps recorded when the run is long enough: a few steps show the pattern, more only grow the file
ACTIVE_STEPS = 3


def profile_schedule(steps: int) -> tuple[int, int, int]:
    """(wait, warmup, active) for a run of ``steps`` steps: 1, 1 and up to 3 when there is room; a short
    run gives up waiting first, then warming up, so at least one step is always recorded."""
    wait = 1 if steps >= 3 else 0
    warmup = 1 if steps - wait >= 2 else 0
    return wait, warmup, max(1, min(ACTIVE_STEPS, steps - wait - warmup))


def check_directory(directory: str) -> None:
    """Raise ValueError unless ``directory`` is, or can be created as, a directory."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--torch-profile {directory} is a file; give a directory for the rank traces")
    if not path.exists() and not path.parent.is_dir():
        raise ValueError(
            f"--torch-profile {directory}: directory {path.parent} does not exist; create it or choose "
            "another path"
        )


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
