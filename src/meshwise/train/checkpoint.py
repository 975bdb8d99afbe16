"""Training checkpoints, one layout for every trainer: ``torch.distributed.checkpoint`` (DCP) keyed by the
plain model's names, with an atomic pointer to the latest complete one.

Why DCP: every rank writes only the tensors (or ZeRO shards) it owns, recorded by parameter name, and a
load asks for the pieces the *new* layout needs. So a checkpoint of one layout (ZeRO-3 on 2 ranks) loads
into any other (3 ranks, another stage, one process), no rank gathers the whole model to save it, and
torch's own ``dcp_to_torch_save`` reads it without meshwise.

Layout of ``DIR``::

    step-000100/       a DCP checkpoint: {"model": ..., "optim": ...} by name (``train gpt`` adds each
                       rank's random streams, see :mod:`meshwise.train.random_state`)
    run.json           format, the step completed (naming its step-* directory) and what the trainer needs
                       to continue — written by rank 0 once every rank's part is saved, via a rename

A job killed mid-save leaves ``run.json`` naming the previous complete step; older ``step-*`` directories
are removed only after ``run.json`` points past them. ``--resume`` checks ``run.json`` before any rank
starts.

What each trainer keeps in ``run.json`` is its loop's ``_run_record`` (docs/training.md, docs/gpt.md).
``train mlp|cnn|deep-mlp`` (:data:`TRAIN_FORMAT`) keeps its dataset's name, so a resume on other data is
refused by name rather than failing on a tensor shape, its sampler and rank 0's generator. ``train gpt``
(:data:`GPT_FORMAT`) keeps the layout that wrote it (``mesh``: random streams are restored only on the
same one) and the data position (``data``: the sampler is a pure function of it and the step).
``meshwise-gpt/1`` (before ``mesh``, ``data`` and ``rng``) is still read: it continues from its ``step``
with the streams re-derived as on another layout — exact without ``--dropout``, deterministic with it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from meshwise.runtime.env import detect_launch_env
from meshwise.train.checkpoint_check import check_dcp_checkpoint

RUN_FILE = "run.json"
TRAIN_FORMAT = "meshwise-train/2"
GPT_FORMAT = "meshwise-gpt/2"
#: the formats ``train gpt`` resumes, newest first
GPT_READS = (GPT_FORMAT, "meshwise-gpt/1")
#: what ``train mlp|cnn|deep-mlp`` reads back; a run.json without one of them is not a usable checkpoint
KEYS = ("model", "epoch", "sampler", "rng", "run", "history")


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:06d}"


def run_file(directory: str | Path) -> Path:
    return Path(directory) / RUN_FILE


def read_run(directory: str | Path, format: str | tuple[str, ...], what: str = "") -> dict[str, Any]:
    """``DIR/run.json`` of ``format`` (or one of several, newest first), or one clear error when there is
    nothing (of ours) to resume; ``what`` names the kind (``"GPT "``). Another version of the same family
    (``meshwise-gpt/3``) is named as such, so a newer or older meshwise's is not called a stranger's."""
    formats = (format,) if isinstance(format, str) else format
    path = run_file(directory)
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"--resume: checkpoint directory {directory} does not exist")
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: nothing to resume")
    try:
        run = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not readable JSON: {exc}") from None
    found = run.get("format") if isinstance(run, dict) else None
    if isinstance(found, str) and found not in formats and found.split("/")[0] == formats[0].split("/")[0]:
        raise ValueError(
            f"{path} has format {found!r}, which this meshwise does not read (it reads "
            f"{', '.join(formats)}); resume it with the meshwise version that wrote it"
        )
    if found not in formats:
        raise ValueError(f"{path} is not a meshwise {what}checkpoint (format {formats[0]!r} expected)")
    if not isinstance(run.get("step"), int):
        raise ValueError(f"{path} is not a complete meshwise checkpoint (no step)")
    if not step_dir(directory, run["step"]).is_dir():
        raise FileNotFoundError(f"{path} points at {step_dir(directory, run['step'])}, which is missing")
    return run


def save(
    directory: str | Path,
    step: int,
    state: dict[str, Any],
    run: dict[str, Any],
    *,
    format: str,
    is_main: bool,
    barrier: Callable[[], Any],
    keep: int = 1,
) -> Path:
    """Collective: every rank writes its part of ``state``; rank 0 then repoints run.json and prunes
    all but the ``keep`` latest step directories (this one included). A failed run.json write raises on
    rank 0 only, after the last barrier (the others return): the caller agrees on failure if it must."""
    target = step_dir(directory, step)
    dcp.save(state, checkpoint_id=str(target))
    barrier()  # every rank's files are complete before run.json names them
    error: OSError | None = None
    if is_main:
        path = run_file(directory)
        temporary = path.with_name(f".{RUN_FILE}.{os.getpid()}.tmp")
        try:
            with open(temporary, "w") as handle:
                handle.write(json.dumps({"format": format, "step": step, **run}, indent=1) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
            for old in stale_steps(directory, target, keep):
                shutil.rmtree(old, ignore_errors=True)
        except OSError as exc:
            error = exc
        finally:
            temporary.unlink(missing_ok=True)
    barrier()  # on return, on every rank, run.json names this step
    if error is not None:
        raise error
    return target


def stale_steps(directory: str | Path, target: Path, keep: int) -> list[Path]:
    """The step directories ``--keep keep`` removes once run.json names ``target``: every one but
    ``target`` and the ``keep - 1`` latest before it (a later one is left from another run's attempt)."""
    earlier = sorted(p for p in Path(directory).glob("step-*") if p.name < target.name)
    kept = set(earlier[len(earlier) - (keep - 1) :]) if keep > 1 else set()
    return [p for p in Path(directory).glob("step-*") if p != target and p not in kept]


def read_train_run(directory: str | Path) -> dict[str, Any]:
    """``train mlp|cnn|deep-mlp``'s run.json, checked to hold every key a resume reads."""
    run = read_run(directory, TRAIN_FORMAT, "training ")
    missing = [key for key in KEYS if key not in run]
    if missing:
        raise ValueError(
            f"{run_file(directory)} is not a complete meshwise checkpoint (no {', '.join(missing)})"
        )
    return run


def next_step(run: dict[str, Any]) -> int:
    """The first step a resume of ``train gpt``'s ``run`` trains: its data position (a ``meshwise-gpt/1``
    run.json, which has none, continues after its ``step``)."""
    position = run.get("data")
    return int(position["next_step"]) if position is not None else int(run["step"])


def check_writable(directory: str | Path) -> None:
    """Create ``directory`` if needed and write a scratch file in it, so that a path that cannot take a
    checkpoint is refused before training rather than after the first epoch. A real write is the only
    test that also holds for root, read-only mounts and full disks; raises ValueError saying what to do."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory) as probe:
            probe.write(b"meshwise")
            probe.flush()
    except OSError as exc:
        raise ValueError(
            f"--checkpoint {directory} is not writable ({exc.strerror or exc}); choose another directory"
        ) from None


def resumed_directory(checkpoint: str | None, resume: bool) -> Path | None:
    """The ``--checkpoint``/``--resume`` checks every trainer makes first: the directory of the run to
    resume, for the trainer's own checks, or None: no checkpoint, or a new run's, checked here not to
    overwrite one and to be writable (before training rather than at its first checkpoint)."""
    if checkpoint is None:
        return None
    directory = Path(checkpoint)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"--checkpoint {directory} is a file; pass a directory")
    if resume:
        return directory
    if run_file(directory).exists():
        raise ValueError(
            f"{run_file(directory)} already exists; pass --resume to continue that run, or choose another "
            "--checkpoint"
        )
    check_writable(directory)
    return None


def check_resumable(directory: Path, step: int, where: Path, flag: str, done: int, total: int) -> None:
    """The last checks of a run to resume (``where`` names it): ``done`` of ``flag``'s ``total`` leaves
    some to train, and its ``step`` is intact (read without building tensors)."""
    if done >= total:
        raise ValueError(
            f"{where} has already completed {done} of {flag} {total}; pass a larger {flag} to train further"
        )
    check_dcp_checkpoint(step_dir(directory, step))


def resume_requested(checkpoint: str | None, resume: bool) -> bool:
    """``--resume``, or implied by a restart: when a launcher restarted the job after a failure
    (``meshwise run --max-restarts``, torchrun, SLURM requeue) and the run already wrote a checkpoint,
    the restarted ranks continue from it instead of refusing to overwrite it."""
    if resume or checkpoint is None or detect_launch_env().restart_count == 0:
        return resume
    return run_file(checkpoint).exists()
