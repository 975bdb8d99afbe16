"""Hugging Face GPT-2 weights in and out of :class:`~meshwise.models.gpt.GPT`, from local files only.

Why a mapping is needed at all: Hugging Face's GPT-2 keeps OpenAI's original layout. Its projections are
``Conv1D`` modules whose weight is stored (in, out) — the transpose of ``nn.Linear``'s (out, in) — and
attention uses one fused ``c_attn`` of width 3h whose output columns are q, then k, then v (each h wide,
heads contiguous inside each). Ours keeps q/k/v separate so tensor parallelism can cut them by heads, so
loading splits ``c_attn`` in three along its output dimension and transposes every Conv1D weight;
exporting concatenates and transposes back. Names map one to one otherwise:

=============================  ===========================  =====================================
Hugging Face                   meshwise                      how
=============================  ===========================  =====================================
transformer.wte / wpe          wte / wpe                     as is
h.i.ln_1 / ln_2                blocks.i.ln1 / ln2            as is
h.i.attn.c_attn (h, 3h)        blocks.i.attn.q / k / v       split columns in 3, transpose each
h.i.attn.c_proj (h, h)         blocks.i.attn.out             transpose
h.i.mlp.c_fc (h, 4h)           blocks.i.mlp.fc               transpose
h.i.mlp.c_proj (4h, h)         blocks.i.mlp.proj             transpose
transformer.ln_f               ln_f                          as is
lm_head                        head (tied to wte)            dropped on load, written on export
=============================  ===========================  =====================================

The number of heads is not recoverable from the weights, so it comes from the folder's ``config.json``
(``n_head``) or the caller. Files: ``model.safetensors`` (needs the ``safetensors`` package) or
``pytorch_model.bin`` (read with ``weights_only=True``: no code in a pickle runs). Nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from meshwise.models.gpt import GPT, GPTConfig

SAFETENSORS = "model.safetensors"
PICKLE = "pytorch_model.bin"
_CONV1D = {"attn.c_proj": "attn.out", "mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}
_AS_IS = {"ln_1": "ln1", "ln_2": "ln2"}


#: the id of GPT-2's ``<|endoftext|>`` token, its bos and eos (the last of its 50,257)
GPT2_END_OF_TEXT = 50256


def weights_file(path: str | Path) -> Path:
    """The weights file of ``path`` (a file, or a folder holding model.safetensors or pytorch_model.bin)."""
    path = Path(path)
    if path.is_dir():
        for name in (SAFETENSORS, PICKLE):
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(f"{path} holds neither {SAFETENSORS} nor {PICKLE}")
    if not path.is_file():
        raise FileNotFoundError(f"GPT-2 weights {path} do not exist")
    return path


def read_state_dict(path: str | Path, *, meta: bool = False) -> dict[str, torch.Tensor]:
    """The raw Hugging Face state dict in ``path`` (file or folder), on the CPU; with ``meta`` its tensors
    are not read (meta tensors from the safetensors header, or a memory map), so that checking a 500 MB
    checkpoint's shapes before launch costs milliseconds."""
    file = weights_file(path)
    if file.suffix == ".safetensors":
        try:
            from safetensors import safe_open
        except ImportError:
            raise ImportError(
                f"reading {file} needs the safetensors package: pip install safetensors"
            ) from None
        with safe_open(str(file), framework="pt") as handle:
            return {
                key: torch.empty(handle.get_slice(key).get_shape(), device="meta")
                if meta
                else handle.get_tensor(key)
                for key in handle.keys()  # noqa: SIM118 (not a dict)
            }
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=meta)
    except RuntimeError:  # the legacy (non-zip) format cannot be mapped
        if not meta:
            raise
        return torch.load(file, map_location="cpu", weights_only=True)


def _strip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys relative to the transformer (``GPT2LMHeadModel`` prefixes ``transformer.``, ``GPT2Model`` not);
    the causal-mask buffers some versions save (``attn.bias``, ``attn.masked_bias``) are not weights."""
    out = {}
    for key, value in state.items():
        key = key.removeprefix("transformer.")
        if key.split(".")[-2:] in (["attn", "bias"], ["attn", "masked_bias"]) or key == "lm_head.weight":
            continue
        out[key] = value
    return out


def config_from_state_dict(state: dict[str, torch.Tensor], heads: int) -> GPTConfig:
    """The GPTConfig whose shapes ``state`` fills; ``heads`` is the one thing the weights do not say."""
    state = _strip(state)
    if "wte.weight" not in state or "wpe.weight" not in state:
        raise ValueError("not a GPT-2 state dict: no wte.weight / wpe.weight (token and position tables)")
    vocab, hidden = state["wte.weight"].shape
    layers = len({key.split(".")[1] for key in state if key.startswith("h.")})
    return GPTConfig(
        layers=layers, hidden=hidden, heads=heads, seq_len=state["wpe.weight"].shape[0], vocab=vocab
    ).validate()


def from_hf_state_dict(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """Our state dict (no ``head.weight``: it is ``wte.weight``) from a Hugging Face GPT-2 one."""
    state = _strip(state)
    h = config.hidden
    out: dict[str, torch.Tensor] = {}
    for key in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"):
        out[key] = state.pop(key)
    for i in range(config.layers):
        ours, theirs = f"blocks.{i}.", f"h.{i}."
        weight, bias = state.pop(theirs + "attn.c_attn.weight"), state.pop(theirs + "attn.c_attn.bias")
        for j, name in enumerate(("q", "k", "v")):
            out[f"{ours}attn.{name}.weight"] = weight[:, j * h : (j + 1) * h].t().contiguous()
            out[f"{ours}attn.{name}.bias"] = bias[j * h : (j + 1) * h].clone()
        for hf, mine in _CONV1D.items():
            out[f"{ours}{mine}.weight"] = state.pop(f"{theirs}{hf}.weight").t().contiguous()
            out[f"{ours}{mine}.bias"] = state.pop(f"{theirs}{hf}.bias")
        for hf, mine in _AS_IS.items():
            for part in ("weight", "bias"):
                out[f"{ours}{mine}.{part}"] = state.pop(f"{theirs}{hf}.{part}")
    if state:
        raise ValueError(f"unexpected GPT-2 weights, not mapped: {', '.join(sorted(state)[:5])}")
    return out


def to_hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """``GPT2LMHeadModel``'s state dict (Conv1D layout, fused c_attn, ``lm_head`` tied) of our model."""
    config, state = model.config, {k: v.detach().cpu() for k, v in model.state_dict().items()}
    plain = ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")
    out = {f"transformer.{key}": state[key] for key in plain}
    for i in range(config.layers):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        out[theirs + "attn.c_attn.weight"] = (
            torch.cat([state[f"{ours}attn.{n}.weight"] for n in ("q", "k", "v")]).t().contiguous()
        )
        out[theirs + "attn.c_attn.bias"] = torch.cat([state[f"{ours}attn.{n}.bias"] for n in ("q", "k", "v")])
        for hf, mine in _CONV1D.items():
            out[f"{theirs}{hf}.weight"] = state[f"{ours}{mine}.weight"].t().contiguous()
            out[f"{theirs}{hf}.bias"] = state[f"{ours}{mine}.bias"]
        for hf, mine in _AS_IS.items():
            for part in ("weight", "bias"):
                out[f"{theirs}{hf}.{part}"] = state[f"{ours}{mine}.{part}"]
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def load_hf_gpt2(path: str | Path, *, heads: int | None = None) -> GPT:
    """A GPT holding the Hugging Face GPT-2 weights in ``path`` (file, or folder with config.json)."""
    state = read_state_dict(path)
    if heads is None:
        config_json = (Path(path) if Path(path).is_dir() else Path(path).parent) / "config.json"
        if not config_json.is_file():
            raise ValueError(f"no config.json next to {path}: pass heads= (GPT-2 small has 12)")
        heads = int(json.loads(config_json.read_text())["n_head"])
    config = config_from_state_dict(state, heads)
    with torch.device("meta"):
        model = GPT(config)
    model.load_state_dict(from_hf_state_dict(state, config), strict=False, assign=True)
    model.head.weight = model.wte.weight  # assign= replaced wte's tensor: re-tie the head to it
    return model


def save_hf_gpt2(model: GPT, directory: str | Path) -> Path:
    """Write ``model.safetensors`` (or ``pytorch_model.bin`` without safetensors) and a GPT-2
    ``config.json`` into ``directory``, loadable by ``GPT2LMHeadModel.from_pretrained``; return the file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    c = model.config
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab,
        "n_positions": c.seq_len,
        "n_embd": c.hidden,
        "n_layer": c.layers,
        "n_head": c.heads,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
        # GPT-2's <|endoftext|> starts and ends texts; a smaller (byte) vocabulary has no such token
        "bos_token_id": GPT2_END_OF_TEXT if c.vocab > GPT2_END_OF_TEXT else None,
        "eos_token_id": GPT2_END_OF_TEXT if c.vocab > GPT2_END_OF_TEXT else None,
        "resid_pdrop": c.dropout,
        "embd_pdrop": c.dropout,
        "attn_pdrop": c.dropout,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = to_hf_state_dict(model)
    try:
        from safetensors.torch import save_file
    except ImportError:
        torch.save(state, directory / PICKLE)
        return directory / PICKLE
    state.pop("lm_head.weight")  # safetensors refuses shared storage; the tie restores it on load
    save_file(state, str(directory / SAFETENSORS), metadata={"format": "pt"})
    return directory / SAFETENSORS
