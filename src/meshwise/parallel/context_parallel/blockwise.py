"""Causal attention of one query chunk over the keys before it, in memory linear in the sequence.

Query chunk ``g`` sees every key of chunks ``0..g−1`` and, in its own chunk, the keys up to itself: a
mask aligned to the *lower right* of a (c × (g+1)c) block. PyTorch's fused CPU kernel applies only the
top-left causal mask (``is_causal``) without materialising scores; given an explicit mask it falls back to
the kernel that keeps the (c × (g+1)c) probabilities for backward — memory quadratic in the sequence, the
very thing context parallelism is for. So the block is computed as two fused calls, as ring attention
does: the past chunks without a mask, the own chunk with ``is_causal``, merged by their log-sum-exps:

    out = o_past·exp(lse_past − lse) + o_own·exp(lse_own − lse),   lse = logaddexp(lse_past, lse_own)

Backward needs no merge: the gradient of each part is the fused backward of that part called with the
*merged* output and log-sum-exp (the softmax over all keys is what each part's probabilities belong to).
Kept for backward: q, the visible keys and values (views of the gathered ones), the output and the
log-sum-exp — O(s). Off the CPU, or with attention dropout (whose masks the two calls could not share),
the explicit-mask path is used.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

_FUSED = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FUSED_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def chunk_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, dropout_p: float = 0.0
) -> torch.Tensor:
    """Attention of the query chunk ``q`` (its c positions are the last c of ``keys``) over ``keys``."""
    c, visible = q.shape[-2], keys.shape[-2]
    if visible == c:
        return F.scaled_dot_product_attention(q, keys, values, dropout_p=dropout_p, is_causal=True)
    if q.device.type != "cpu" or dropout_p > 0:
        mask = torch.ones(c, visible, dtype=torch.bool, device=q.device).tril(visible - c)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=dropout_p)
    return _PastAndOwn.apply(q, keys, values)


class _PastAndOwn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        past = keys.shape[-2] - q.shape[-2]
        o_past, lse_past = _FUSED(q, keys[..., :past, :], values[..., :past, :], 0.0, False)
        o_own, lse_own = _FUSED(q, keys[..., past:, :], values[..., past:, :], 0.0, True)
        lse = torch.logaddexp(lse_past, lse_own)
        out = o_past * (lse_past - lse).exp().unsqueeze(-1) + o_own * (lse_own - lse).exp().unsqueeze(-1)
        ctx.save_for_backward(q, keys, values, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, keys, values, out, lse = ctx.saved_tensors
        past = keys.shape[-2] - q.shape[-2]
        grad = grad.contiguous()
        dq_past, dk_past, dv_past = _FUSED_BACKWARD(
            grad, q, keys[..., :past, :], values[..., :past, :], out, lse, 0.0, False
        )
        dq_own, dk_own, dv_own = _FUSED_BACKWARD(
            grad, q, keys[..., past:, :], values[..., past:, :], out, lse, 0.0, True
        )
        return dq_past + dq_own, torch.cat((dk_past, dk_own), dim=-2), torch.cat((dv_past, dv_own), dim=-2)
