"""GPT-2: the transformer that sharded, tensor- and pipeline-parallel training exist for.

The architecture is GPT-2's (token + learned position embeddings, pre-LayerNorm blocks of causal
self-attention and a 4h GELU MLP, a final LayerNorm, an output head tied to the token embedding), written so
that the other strategies can cut it without rewriting it:

- blocks live in a ``ModuleList`` (pipeline stages and ZeRO-3 units are slices of it);
- attention has separate ``q``/``k``/``v``/``out`` projections and the MLP ``fc``/``proj``, so tensor
  parallelism replaces each with a column- or row-parallel linear; attention derives its number of heads
  from the width of ``q``'s output at run time, so a rank holding ``heads/tp`` heads needs no other change;
- the forward pass is three public pieces — :meth:`GPT.embed`, the blocks, :meth:`GPT.logits` — that a
  pipeline stage can call separately.

The shape (:class:`GPTConfig`, the named configs, parameter and FLOP counts) lives in the torch-free
:mod:`meshwise.models.gpt_shape` and is re-exported here. A model built under ``torch.device("meta")``
allocates no memory, so its parameters can be counted for models this host cannot hold.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshwise.models.gpt_shape import CONFIGS as CONFIGS
from meshwise.models.gpt_shape import GPTConfig
from meshwise.models.gpt_shape import gpt_config as gpt_config
from meshwise.models.moe import MixtureOfExperts


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with separate q/k/v/out projections.

    The number of heads is ``q``'s output width over ``head_dim``, read at run time, so tensor
    parallelism can hand each rank a column slice of q/k/v (whole heads) and a row slice of ``out``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        h = config.hidden
        self.head_dim = config.head_dim
        self.q = nn.Linear(h, h)
        self.k = nn.Linear(h, h)
        self.v = nn.Linear(h, h)
        self.out = nn.Linear(h, h)
        self.dropout = config.dropout

    #: how :meth:`core` is run, ``run_core(core, q, k, v)``; None: directly (parallel/recompute sets it)
    run_core: Callable[..., torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(*self.project(x))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of (batch, seq, hidden) inputs; tensor parallelism overrides it to add communication."""
        return self.q(x), self.k(x), self.v(x)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over the heads of the projections, then the output projection."""
        batch, seq, width = q.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(batch, seq, width // self.head_dim, self.head_dim).transpose(1, 2)

        q, k, v = heads(q), heads(k), heads(v)
        attended = self.core(q, k, v) if self.run_core is None else self.run_core(self.core, q, k, v)
        return self.out(attended.transpose(1, 2).reshape(batch, seq, -1))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q·kᵀ/√d + causal mask)·v over (batch, heads, seq, head_dim): what selective
        recomputation runs again in backward instead of keeping its (batch, heads, seq, seq) tensors."""
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )


class MLP(nn.Module):
    """h → 4h → h with GPT-2's tanh-approximated GELU (so Hugging Face weights give the same logits)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden, 4 * config.hidden)
        self.proj = nn.Linear(4 * config.hidden, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


def mixture_of_experts(config: GPTConfig) -> MixtureOfExperts:
    """The MoE layer a block uses for its MLP: experts that are the plain MLP (same bias, same init)."""
    return MixtureOfExperts(
        config.hidden,
        config.experts,
        config.top_k,
        lambda: MLP(config),
        capacity_factor=config.capacity_factor,
        balance_coef=config.aux_loss_coef,
        z_loss_coef=config.z_loss_coef,
    )


#: Linears that write into the residual stream, initialised with std 0.02/√(2·layers) (an expert's proj too).
RESIDUAL_PROJECTION = re.compile(r".*(attn\.out|mlp\.proj|mlp\.experts\.\d+\.proj)")


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.hidden)
        self.mlp = MLP(config) if not config.experts else mixture_of_experts(config)
        self.dropout = nn.Dropout(config.dropout)

    #: how :meth:`body` is run, ``run_body(body, x)``; None: directly (parallel/recompute sets it)
    run_body: Callable[..., torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) if self.run_body is None else self.run_body(self.body, x)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln1(x)))
        return x + self.dropout(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """GPT-2 language model; ``forward(tokens)`` returns logits of shape (batch, seq, vocab)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config.validate()
        self.wte = nn.Embedding(config.vocab, config.hidden)
        self.wpe = nn.Embedding(config.seq_len, config.hidden)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2: one parameter, counted once
        if self.wte.weight.device.type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's initialisation: N(0, 0.02), residual projections scaled by 1/√(2·layers)."""
        residual_std = 0.02 / math.sqrt(2 * self.config.layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if RESIDUAL_PROJECTION.fullmatch(name) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token plus position embeddings of (batch, seq) token ids → (batch, seq, hidden)."""
        seq = tokens.shape[-1]
        if seq > self.config.seq_len:
            raise ValueError(
                f"sequence of {seq} tokens is longer than the position table ({self.config.seq_len}); "
                f"lower --seq-len or build the model with a longer one"
            )
        positions = torch.arange(seq, device=tokens.device)
        return self.drop(self.wte(tokens) + self.wpe(positions))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final LayerNorm and the tied head: (batch, seq, hidden) → (batch, seq, vocab)."""
        return self.head(self.ln_f(x))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.logits(x)

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``new_tokens`` continuations of (batch, seq) prompts, cropping to the context window."""
        for _ in range(new_tokens):
            window = tokens[:, -self.config.seq_len :]
            scores = self(window)[:, -1, :] / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(scores, min(top_k, scores.shape[-1])).values[:, -1:]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            probs = F.softmax(scores, dim=-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return tokens


def language_model_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position (targets are the inputs shifted by one)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
