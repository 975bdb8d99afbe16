"""``--init-from PATH``: start a GPT run from Hugging Face GPT-2 weights; ``--export-hf DIR``: save them.

The architecture comes from the checkpoint, not from flags: ``config.json`` beside the weights gives the
layers, width, heads, vocabulary and context (the weights' shapes are checked against it). ``--config`` and
``--layers/--hidden/--heads/--vocab``, when given as well, must agree with it, and a mismatch is one line
naming both before any rank starts. Without ``config.json`` the weights still give every size but the
number of heads, which then comes from ``--config`` or ``--heads``.

Every rank reads the file itself rather than rank 0 reading it and broadcasting: the file is local and
memory-mapped, every strategy (data, tensor, pipeline parallel) starts from the *full* weights and cuts them
itself, so a broadcast would move the same bytes through the communicator that a read takes from the page
cache, and this is how ``--data`` is read too. A multi-node job therefore needs PATH on every node.

With ``--resume`` the checkpoint wins: its weights were trained from the Hugging Face ones, so these are not
read at all (the model shape must still match, which the resume check does).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from meshwise.models.gpt import GPT, GPTConfig, gpt_config
from meshwise.models.gpt_hf import config_from_state_dict, from_hf_state_dict, read_state_dict, weights_file

#: what a GPT-2 ``config.json`` calls our architecture fields
_HF_NAMES = {
    "layers": "n_layer",
    "hidden": "n_embd",
    "heads": "n_head",
    "seq_len": "n_positions",
    "vocab": "vocab_size",
}


def describe(config: GPTConfig) -> str:
    return ", ".join(f"{name} {getattr(config, name)}" for name in _HF_NAMES)


#: config.json fields that change the function a GPT-2 computes, with the values our model computes;
#: a checkpoint that sets one otherwise is refused rather than loaded into a different function
_FUNCTION_FIELDS: dict[str, tuple[object, ...]] = {
    "activation_function": ("gelu_new", "gelu_pytorch_tanh"),  # both are GELU's tanh approximation
    "layer_norm_epsilon": (1e-5,),
    "scale_attn_weights": (True,),
    "scale_attn_by_inverse_layer_idx": (False,),
    "reorder_and_upcast_attn": (False,),
    "tie_word_embeddings": (True,),  # an untied lm_head would be dropped: our head is the embedding
}


def _from_config_json(path: Path) -> GPTConfig | None:
    config_json = (path if path.is_dir() else path.parent) / "config.json"
    if not config_json.is_file():
        return None
    try:
        data = json.loads(config_json.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_json} is not a GPT-2 config.json ({exc!r}): fix or remove it") from None
    kind = data.get("model_type", "gpt2") if isinstance(data, dict) else None
    if kind != "gpt2":
        raise ValueError(
            f"--init-from {path}: config.json describes a {kind!r} model, not GPT-2 (model_type 'gpt2'): "
            "meshwise train gpt starts only from GPT-2 checkpoints"
        )
    wrong = [  # each field whose value makes a function our GPT does not compute
        f"{name} {data[name]!r} (ours: {' or '.join(map(repr, ours))})"
        for name, ours in _FUNCTION_FIELDS.items()
        if name in data and data[name] not in ours
    ]
    inner, width = data.get("n_inner"), data.get("n_embd")
    if inner is not None and inner != 4 * (width or 0):
        wrong.append(f"n_inner {inner!r} (ours: 4·n_embd = {4 * (width or 0)})")
    if wrong:
        raise ValueError(
            f"--init-from {path}: config.json sets {'; '.join(wrong)}: meshwise's GPT-2 computes another "
            "function, so these weights would not mean what they were trained to; use a checkpoint with "
            "GPT-2's values"
        )
    try:
        values = {ours: int(data[theirs]) for ours, theirs in _HF_NAMES.items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{config_json} is not a GPT-2 config.json ({exc!r}): fix or remove it") from None
    return GPTConfig(**values)


def init_model_config(path: str, name: str | None, overrides: dict[str, int | None]) -> GPTConfig:
    """The model of an ``--init-from`` run, checked against ``--config NAME`` and the size flags given."""
    try:
        file = weights_file(path)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"--init-from: {exc}") from None
    asked = gpt_config(name, **overrides) if name is not None else None
    heads = asked.heads if asked is not None else overrides.get("heads")
    declared = _from_config_json(Path(path))
    try:
        config = config_from_state_dict(
            read_state_dict(file, meta=True), declared.heads if declared else heads or 1
        )
    except ValueError as exc:
        raise ValueError(f"--init-from {path}: {exc}") from None
    if declared is None and heads is None:
        raise ValueError(
            f"--init-from {path}: no config.json beside the weights to give the number of heads; add the "
            "folder's config.json, or pass --heads N (or the matching --config)"
        )
    if declared is not None:
        if replace(declared, heads=config.heads) != config:
            raise ValueError(
                f"--init-from {path}: config.json says {describe(declared)} but the weights have "
                f"{describe(replace(config, heads=declared.heads))}: the files do not belong together"
            )
        config = declared.validate()
    flags = {key: value for key, value in overrides.items() if value is not None}
    if asked is not None:
        flags = {key: getattr(asked, key) for key in _HF_NAMES}
    wrong = [key for key, value in flags.items() if getattr(config, key) != value]
    if wrong:
        if name is not None:
            given = f"--config {name}"
            clash = f"{given} asks for {', '.join(f'{key} {flags[key]}' for key in wrong)}"
        else:
            given = " ".join(f"--{key.replace('_', '-')} {flags[key]}" for key in wrong)
            clash = f"{given} disagrees"
        raise ValueError(
            f"--init-from {path} holds a GPT-2 with {describe(config)}, but {clash}: drop {given} (the "
            "checkpoint's architecture is used) or pass matching values"
        )
    return config


def load_weights(model: GPT, path: str) -> None:
    """Overwrite ``model``'s weights (built with :func:`init_model_config`'s config) with the file's."""
    state = from_hf_state_dict(read_state_dict(path), model.config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) != {"head.weight"}:  # the head is tied to wte, not stored
        raise ValueError(f"--init-from {path}: weights do not fit the model ({missing=}, {unexpected=})")


def check_export_dir(directory: str) -> None:
    """``--export-hf DIR`` must be a writable folder (created if missing), checked before launch."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--export-hf {directory} is a file; name a folder (it is created if missing)")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--export-hf {directory}: {existing} is not writable; choose another folder")
