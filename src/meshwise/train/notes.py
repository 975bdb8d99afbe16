"""The notes rank 0 prints under a run's banner: settings that are allowed but deserve a sentence, each a
pure function of the settings and a resumed checkpoint's run.json (testable without a run).

A resume may change settings (train further, more ranks), but never silently: a user who mistyped
``--lr`` on a resume sees it on the first line rather than in a ruined checkpoint. Only other data is
refused (:func:`check_dataset`).

For ``train mlp|cnn|deep-mlp``, other ranks with the same global batch (ranks × ``--batch-size``) are no
difference: every rank takes every W-th sample of one permutation, so each step's global batch holds the
same samples on 2 ranks × 48 as on 3 × 32, and the checkpoint (DCP, by name) loads on any number of ranks
and any ``--zero`` stage. When that count divides the epoch without padding, the resumed run continues
the uninterrupted one.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshwise.data.tokens import TOKEN_SUFFIX
from meshwise.train.errors import TrainingError

if TYPE_CHECKING:  # the GPT's settings, which the mlp trainer need not import
    from meshwise.train.gpt.resolve import GPTRun
    from meshwise.train.gpt.sections import OptimizerSection

BYTE_VOCAB = 256


def check_dataset(saved: str | None, current: str, path: str) -> None:
    """Refuse to resume a checkpoint of other data (checkpoints written before the key was kept pass)."""
    if saved is not None and saved != current:
        raise TrainingError(
            f"{path} was trained on {saved}, but this run loads {current}; pass the same data "
            "(--data) as the run that wrote it, or another --checkpoint",
            exit_code=2,
        )


def resume_notes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One note per setting in ``current`` (same keys as a checkpoint's ``run``) that ``saved`` differs in."""
    notes = []
    saved_global = saved["world_size"] * saved["batch_size"]
    if saved_global != current["world_size"] * current["batch_size"]:
        notes.append(
            f"the checkpoint was written by {saved['world_size']} ranks with batch "
            f"{saved['batch_size']}/rank; continuing with {current['world_size']} × "
            f"{current['batch_size']} changes the global batch, so the run will not match an uninterrupted "
            f"one (keep ranks × --batch-size = {saved_global} to continue it exactly)"
        )
    if saved["lr"] != current["lr"]:
        notes.append(
            f"the checkpoint's run used lr {saved['lr']:g}; the remaining epochs use {current['lr']:g} "
            "(from --lr, scaled by the ranks unless --no-lr-scaling)"
        )
    if saved["seed"] != current["seed"]:
        notes.append(
            f"--seed {current['seed']} differs from the checkpoint's {saved['seed']}; a resume keeps the "
            "checkpoint's shuffling and generator state, so --seed has no effect on it"
        )
    if saved["epochs"] != current["epochs"]:
        notes.append(
            f"--epochs {current['epochs']} differs from the checkpoint's {saved['epochs']}; the cosine "
            "learning-rate decay is recomputed for the new length"
        )
    return notes


def vocabulary_note(run: GPTRun, vocab: int) -> str | None:
    """With --init-from, a checkpoint whose vocabulary is not the data's when the data is read as bytes
    (text, or the default corpus, without a tokenizer; a ``.bin`` file's tokenizer is not recorded): the
    pretrained embeddings then mean other tokens than the ids the data holds (training runs, but starts
    from noise there)."""
    data = run.config.data.data
    as_bytes = data is None or (Path(data).suffix != TOKEN_SUFFIX and run.tokenizer is None)
    if run.config.model.init_from is None or not as_bytes or vocab == BYTE_VOCAB:
        return None
    return (
        f"--init-from's vocabulary has {vocab:,} tokens, but --data is read as bytes ({BYTE_VOCAB} ids): "
        "its pretrained embeddings mean the checkpoint's tokens, not these bytes; give --data as a .bin "
        "file tokenized with the checkpoint's tokenizer"
    )


def schedule_note(optimizer: OptimizerSection, saved_run: dict[str, Any] | None) -> str | None:
    """A resume with another --steps: the learning-rate schedule is a function of the run's length,
    so the remaining steps follow one planned for the new length, not the one the checkpoint began."""
    steps = optimizer.steps
    if saved_run is None or saved_run["run"].get("steps") in (None, steps):
        return None
    before = saved_run["run"]["steps"]
    return (
        f"--steps {steps} differs from the checkpoint's {before}: the learning-rate schedule "
        f"(warmup {optimizer.warmup_steps} steps, {optimizer.lr_schedule} decay to --min-lr "
        f"{optimizer.min_lr:g} at step {steps}) is re-planned for the new length, so steps "
        f"{saved_run['step'] + 1} on follow it rather than the {before}-step plan"
    )


def start_notes(run: GPTRun, vocab: int, saved_run: dict[str, Any] | None) -> list[str]:
    """Every note that applies to this run (``saved_run``: a resumed checkpoint's run.json)."""
    notes = [vocabulary_note(run, vocab), schedule_note(run.config.optimizer, saved_run)]
    return [note for note in notes if note is not None]
