"""Notes rank 0 prints under a GPT run's banner: settings that are allowed but deserve a sentence.

Each is a pure function of the resolved run (and of what a resumed checkpoint recorded), testable
without a run; none stops the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshwise.data.tokens import TOKEN_SUFFIX
from meshwise.train.gpt.resolve import GPTRun
from meshwise.train.gpt.sections import OptimizerSection

BYTE_VOCAB = 256


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
