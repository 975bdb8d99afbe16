"""Causal attention of one query chunk over the keys before it, in memory linear in the sequence.

Query chunk ``g`` sees every key of chunks ``0..g−1`` and its own chunk's keys up to itself: a mask aligned
to the *lower right* of a (c × (g+1)c) block. PyTorch's fused CPU kernel applies only the top-left causal
mask (``is_causal``); given an explicit mask it falls back to keeping the (c × (g+1)c) probabilities —
memory quadratic in the sequence, what context parallelism is for. So :func:`fused_forward` makes the block
two fused calls, as ring attention does (the past chunks unmasked, the own chunk ``is_causal``), merged by
their log-sum-exps::

    out = o_past·exp(lse_past − lse) + o_own·exp(lse_own − lse),   lse = logaddexp(lse_past, lse_own)

:func:`fused_backward` needs no merge: each part's fused backward is called with the *merged* output and
log-sum-exp (each part's probabilities belong to the softmax over all keys), so backward keeps q, keys,
values, output and log-sum-exp — O(s). Off the CPU, or with attention dropout (whose masks two calls
could not share), :func:`masked_attention` is the plain explicit-mask path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_FUSED = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FUSED_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def fused_available(q: torch.Tensor, dropout_p: float) -> bool:
    """Whether :func:`fused_forward`/:func:`fused_backward` apply (PyTorch's CPU kernel, no dropout)."""
    return q.device.type == "cpu" and dropout_p == 0


def masked_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, dropout_p: float
) -> torch.Tensor:
    """Autograd attention of query chunk ``q`` (its positions the last of ``keys``') with an explicit mask."""
    c, visible = q.shape[-2], keys.shape[-2]
    if visible == c:
        return F.scaled_dot_product_attention(q, keys, values, dropout_p=dropout_p, is_causal=True)
    mask = torch.ones(c, visible, dtype=torch.bool, device=q.device).tril(visible - c)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=dropout_p)


def fused_forward(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp) of query chunk ``q`` over ``keys``/``values`` (see the module docstring)."""
    past = keys.shape[-2] - q.shape[-2]
    own_out, own_lse = _FUSED(q, keys[..., past:, :], values[..., past:, :], 0.0, True)
    if past == 0:
        return own_out, own_lse
    past_out, past_lse = _FUSED(q, keys[..., :past, :], values[..., :past, :], 0.0, False)
    lse = torch.logaddexp(past_lse, own_lse)
    out = past_out * (past_lse - lse).exp().unsqueeze(-1) + own_out * (own_lse - lse).exp().unsqueeze(-1)
    return out, lse


def fused_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV of :func:`fused_forward` from its output's gradient."""
    past = keys.shape[-2] - q.shape[-2]
    grad, out = grad.contiguous(), out.contiguous()
    dq, dk_own, dv_own = _FUSED_BACKWARD(
        grad, q, keys[..., past:, :], values[..., past:, :], out, lse, 0.0, True
    )
    if past == 0:
        return dq, dk_own, dv_own
    dq_past, dk_past, dv_past = _FUSED_BACKWARD(
        grad, q, keys[..., :past, :], values[..., :past, :], out, lse, 0.0, False
    )
    return dq + dq_past, torch.cat((dk_past, dk_own), dim=-2), torch.cat((dv_past, dv_own), dim=-2)
