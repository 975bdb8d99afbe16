"""GPT checkpoints through ``torch.distributed.checkpoint`` (DCP), with an atomic pointer to the latest.

Why DCP rather than one ``torch.save`` file: every rank writes the tensors it owns and DCP records which
logical tensor (by parameter name) each piece belongs to, so a checkpoint written by one layout (data
parallel on 2 ranks) loads into another (ZeRO shards, tensor-parallel slices) once those strategies land,
and no rank has to gather the whole model to save it.

Layout of ``DIR``::

    step-000100/       a DCP checkpoint: {"model": ..., "optim": ...} (model and AdamW state by name)
    run.json           format, the step completed, which step-* directory holds it, the model and run
                       settings, and the metrics history — written by rank 0 after every rank finished
                       its part of the DCP save, via a temporary file renamed into place

A job killed mid-save leaves ``run.json`` naming the previous complete step; older ``step-*`` directories
are removed only after ``run.json`` points past them. ``run.json`` is also what ``--resume`` checks before
any rank starts.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

FORMAT = "meshwise-gpt/1"
RUN_FILE = "run.json"


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:06d}"


def read_run(directory: str | Path) -> dict[str, Any]:
    """``DIR/run.json``, or a clear error when there is nothing (of ours) to resume."""
    path = Path(directory) / RUN_FILE
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"--resume: checkpoint directory {directory} does not exist")
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: nothing to resume")
    try:
        run = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(run, dict) or run.get("format") != FORMAT:
        raise ValueError(f"{path} is not a meshwise GPT checkpoint (format {FORMAT!r} expected)")
    if not step_dir(directory, run["step"]).is_dir():
        raise FileNotFoundError(f"{path} points at {step_dir(directory, run['step'])}, which is missing")
    return run


def save(
    directory: str | Path,
    step: int,
    state: dict[str, Any],
    run: dict[str, Any],
    *,
    is_main: bool,
    barrier: Any,
    keep: int = 1,
) -> Path:
    """Collective: every rank writes its part of ``state``; rank 0 then repoints run.json and prunes
    all but the ``keep`` latest step directories (this one included)."""
    target = step_dir(directory, step)
    dcp.save(state, checkpoint_id=str(target))
    barrier()  # every rank's files are complete before run.json names them
    if is_main:
        path = Path(directory) / RUN_FILE
        temporary = path.with_name(f".{RUN_FILE}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"format": FORMAT, "step": step, **run}, indent=1) + "\n")
        os.replace(temporary, path)
        for old in stale_steps(directory, target, keep):
            shutil.rmtree(old, ignore_errors=True)
    barrier()  # on return, on every rank, run.json names this step
    return target


def stale_steps(directory: str | Path, target: Path, keep: int) -> list[Path]:
    """The step directories ``--keep keep`` removes once run.json names ``target``: every one but
    ``target`` and the ``keep - 1`` latest before it (a later one is left from another run's attempt)."""
    earlier = sorted(p for p in Path(directory).glob("step-*") if p.name < target.name)
    kept = set(earlier[len(earlier) - (keep - 1) :]) if keep > 1 else set()
    return [p for p in Path(directory).glob("step-*") if p != target and p not in kept]


def load(directory: str | Path, state: dict[str, Any]) -> dict[str, Any]:
    """Fill ``state`` (tensors in place) from the checkpoint run.json names; return run.json."""
    run = read_run(directory)
    dcp.load(state, checkpoint_id=str(step_dir(directory, run["step"])))
    return run
