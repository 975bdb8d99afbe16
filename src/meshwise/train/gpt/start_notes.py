"""Notes rank 0 prints under a GPT run's banner: settings that are allowed but deserve a sentence.

Each is a pure function of the configuration (and of what a resumed checkpoint recorded), testable
without a run; none stops the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshwise.data.tokens import TOKEN_SUFFIX
from meshwise.train.gpt.config import GPTTrainConfig

BYTE_VOCAB = 256


def data_tokenizer(config: GPTTrainConfig) -> str | None:
    """How ``--data`` becomes token ids: "bytes" for text (and the default corpus), None for a
    ``.bin`` token file (its tokenizer is not recorded)."""
    if config.data is not None and Path(config.data).suffix == TOKEN_SUFFIX:
        return None
    return "bytes" if config.data is None or config.tokenizer_path is None else "tokenizer"


def vocabulary_note(config: GPTTrainConfig, vocab: int) -> str | None:
    """With --init-from, a checkpoint whose vocabulary is not the data's: the pretrained embeddings
    then mean other tokens than the ids the data holds (training runs, but starts from noise there)."""
    if config.init_from is None or data_tokenizer(config) != "bytes" or vocab == BYTE_VOCAB:
        return None
    return (
        f"--init-from's vocabulary has {vocab:,} tokens, but --data is read as bytes ({BYTE_VOCAB} ids): "
        "its pretrained embeddings mean the checkpoint's tokens, not these bytes; give --data as a .bin "
        "file tokenized with the checkpoint's tokenizer"
    )


def schedule_note(config: GPTTrainConfig, saved_run: dict[str, Any] | None) -> str | None:
    """A resume with another --steps: the learning-rate schedule is a function of the run's length,
    so the remaining steps follow one planned for the new length, not the one the checkpoint began."""
    if saved_run is None or saved_run["run"].get("steps") in (None, config.steps):
        return None
    before = saved_run["run"]["steps"]
    return (
        f"--steps {config.steps} differs from the checkpoint's {before}: the learning-rate schedule "
        f"(warmup {config.warmup_steps} steps, {config.lr_schedule} decay to --min-lr {config.min_lr:g} "
        f"at step {config.steps}) is re-planned for the new length, so steps {saved_run['step'] + 1} on "
        f"follow it rather than the {before}-step plan"
    )


def start_notes(config: GPTTrainConfig, vocab: int, saved_run: dict[str, Any] | None) -> list[str]:
    """Every note that applies to this run (``saved_run``: a resumed checkpoint's run.json)."""
    notes = [vocabulary_note(config, vocab), schedule_note(config, saved_run)]
    return [note for note in notes if note is not None]
