"""Bytes a transformer layer saves for backward, by Korthikanti et al. (2022), for each recompute mode.

The paper's per-layer figures (16-bit values, 1-byte dropout masks; s sequence, b batch, h hidden,
a heads, t tensor-parallel size):

=====================  ==========================
none                   sbh(34 + 5as/h)
tensor parallel        sbh(10 + 24/t + 5as/(ht))
tensor + sequence par  (sbh/t)(34 + 5as/h)
selective recompute    34·sbh/t  (with sequence parallelism)
full recompute         2sbh
=====================  ==========================

Written with ``v`` bytes per value and ``m`` per mask element, the 34 is 16 values and 2 masks (4v + 2m
replicated under plain tensor parallelism: the two LayerNorm inputs, the attention and MLP inputs and the
two residual dropout masks; 12v split: q, k, v, the output projection's input and the MLP's 4h·2) and the
5as/h is the softmax output (v), its dropout mask (m) and the dropout output (v).

Two facts of the kernel change the attention term, and :func:`layer_saved_bytes` takes them as arguments:

- without dropout nothing is masked (no ``m`` terms) and the dropout output is the softmax output (one ``v``);
- a fused ("flash") attention kernel keeps no (s × s) tensor at all, only its output (which is the output
  projection's input, already counted) and one fp32 log-sum-exp per query and head (``4·asb`` bytes).
  PyTorch's CPU kernel is fused when attention dropout is off and falls back to the materialising one
  when it is on; :func:`attention_keeps_scores` asks the installed kernel instead of assuming.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def paper_layer_bytes(
    s: int, b: int, h: int, a: int, *, t: int = 1, sp: bool = False, mode: str = "none"
) -> float:
    """The table above, exactly as published (16-bit values, dropout on, a materialised softmax)."""
    return layer_saved_bytes(s, b, h, a, t=t, sp=sp, mode=mode, value_bytes=2, mask_bytes=1)


def layer_saved_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    *,
    t: int = 1,
    sp: bool = False,
    mode: str = "none",
    value_bytes: int = 2,
    mask_bytes: int = 1,
    dropout: bool = True,
    scores: bool = True,
) -> float:
    """Bytes one layer keeps for backward on each rank (see the module docstring for the terms).

    ``scores=False`` is a fused attention kernel (no s × s tensors, a log-sum-exp instead).
    """
    v, m = value_bytes, (mask_bytes if dropout else 0)
    sbh = s * b * h
    if mode == "full":
        return sbh * v / (t if sp else 1)
    replicated = sbh * (4 * v + 2 * m)
    sharded = sbh * 12 * v
    if mode == "none":
        if scores:
            sharded += a * s * s * b * ((2 * v + m) if dropout else v)
        else:
            sharded += 4 * a * s * b
    elif mode != "selective":
        raise ValueError(f"unknown recompute mode {mode!r}")
    return (replicated + sharded) / t if sp else replicated + sharded / t


def attention_keeps_scores(
    dropout: float, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> bool:
    """Whether this installation's attention saves an (s × s) tensor for backward with ``dropout``
    (``dtype`` None: float32); only this measurement imports torch (the planner prices without it)."""
    import torch
    import torch.nn.functional as F

    from meshwise.parallel.recompute.saved import saved_bytes

    dtype = torch.float32 if dtype is None else dtype
    q = torch.randn(1, 1, 64, 8, device=device, dtype=dtype, requires_grad=True)

    def attention(x: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(x, x, x, dropout_p=dropout, is_causal=True)

    return saved_bytes(attention, q) >= 64 * 64 * q.element_size()
