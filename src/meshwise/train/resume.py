"""What a resumed run says about the settings that differ from the run that wrote its checkpoint.

A resume is allowed to change settings (train further, more ranks), but never silently: each difference
gets a note saying what it changes, so a user who mistyped ``--lr`` on a resume sees it on the first line
rather than in a ruined checkpoint. Plain data in, sentences out: testable without a run.

Other ranks with the same global batch (ranks × ``--batch-size``) are no difference: every rank takes
every W-th sample of one permutation, so each step's global batch holds the same samples on 2 ranks × 48
as on 3 × 32, and the checkpoint (DCP, by name) loads on any number of ranks and any ``--zero`` stage.
When that count divides the epoch without padding, the resumed run continues the uninterrupted one.
"""

from __future__ import annotations

from typing import Any

from meshwise.train.errors import TrainingError


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
