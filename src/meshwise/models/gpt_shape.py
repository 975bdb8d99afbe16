"""The shape of a GPT, torch-free: :class:`GPTConfig`, the named configs, parameter, FLOP and
activation-byte counts.

``meshwise plan`` sizes models with these and nothing else, so they live apart from the modules
(:mod:`meshwise.models.gpt`, which re-exports them) and importing the planner does not import torch.
Parameter counts equal the published GPT-2 ones (``gpt2`` = 124,439,808 with the tied head).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshwise.models.moe_shape import check_experts, moe_parameter_counts
from meshwise.parallel.recompute.formulas import layer_saved_bytes


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT; ``validate()`` says what to change when it cannot be built."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int = 256
    dropout: float = 0.0
    #: Mixture of experts (models/moe.py): 0 keeps the dense MLP; E > 0 makes every block's MLP E experts
    #: behind a top-k router, dropless unless a capacity factor is given.
    experts: int = 0
    top_k: int = 2
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01  # load-balancing loss weight (Switch Transformer's 1e-2)
    z_loss_coef: float = 0.001  # router z-loss weight (ST-MoE's 1e-3)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def validate(self) -> GPTConfig:
        for name in ("layers", "hidden", "heads", "seq_len", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPT {name} must be at least 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(
                f"GPT hidden size {self.hidden} is not divisible by {self.heads} heads: choose --heads "
                f"that divides --hidden (e.g. {_divisor_near(self.hidden, self.heads)})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPT dropout must be in [0, 1), got {self.dropout}")
        if self.experts:
            check_experts(self.experts, self.top_k, self.capacity_factor)
        return self

    def num_parameters(self, *, active: bool = False) -> int:
        """Parameters with the head tied to the token embedding (GPT-2's published counts); with
        ``active``, only those one token uses (a mixture of experts: the router and top-k experts)."""
        h = self.hidden
        mlp = 8 * h * h + 5 * h
        if self.experts:
            total, used = moe_parameter_counts(h, mlp, self.experts, self.top_k)
            mlp = used if active else total
        per_block = 2 * h + (4 * h * h + 4 * h) + 2 * h + mlp
        return self.vocab * h + self.seq_len * h + self.layers * per_block + 2 * h

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6N for the matmuls with the weights plus 12·L·h·T for attention.

        N excludes the position embedding (a lookup, not a matmul) but includes the token embedding,
        which is also the output head. The attention term counts QKᵀ and AV over the full context, as the
        PaLM paper's MFU accounting does (causal masking halves the useful work; the convention ignores
        it), so MFU figures compare with published ones. A mixture of experts counts its active
        parameters (router and top-k experts): the FLOPs a token costs, not the parameters it could use.
        """
        n = self.num_parameters(active=True) - self.seq_len * self.hidden
        return 6 * n + 12 * self.layers * self.hidden * self.seq_len


def _divisor_near(hidden: int, heads: int) -> int:
    divisors = [d for d in range(1, hidden + 1) if hidden % d == 0]
    return min(divisors, key=lambda d: abs(d - heads))


#: Named configurations. ``gpt-tiny`` is for tests (< 1M parameters, 4 layers so pipelines of up to four
#: stages can be cut); ``gpt-nano`` (~10.7M) is the CPU default; ``gpt-moe-*`` are the same shapes with every
#: MLP a mixture of experts (4 resp. 8, top-2); the rest are GPT-2's published sizes.
CONFIGS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(layers=4, hidden=64, heads=4, seq_len=64, vocab=256),
    "gpt-nano": GPTConfig(layers=6, hidden=384, heads=6, seq_len=256, vocab=256),
    "gpt-moe-tiny": GPTConfig(layers=4, hidden=64, heads=4, seq_len=64, vocab=256, experts=4, top_k=2),
    "gpt-moe-nano": GPTConfig(layers=6, hidden=384, heads=6, seq_len=256, vocab=256, experts=8, top_k=2),
    "gpt2": GPTConfig(layers=12, hidden=768, heads=12, seq_len=1024, vocab=50257),
    "gpt2-medium": GPTConfig(layers=24, hidden=1024, heads=16, seq_len=1024, vocab=50257),
    "gpt2-large": GPTConfig(layers=36, hidden=1280, heads=20, seq_len=1024, vocab=50257),
    "gpt2-xl": GPTConfig(layers=48, hidden=1600, heads=25, seq_len=1024, vocab=50257),
}


def gpt_config(name: str, **overrides: int | float | None) -> GPTConfig:
    """A named config with ``None``-valued overrides ignored, validated."""
    if name not in CONFIGS:
        raise ValueError(f"unknown GPT config {name!r}; choose one of {', '.join(CONFIGS)}")
    changes = {key: value for key, value in overrides.items() if value is not None}
    return replace(CONFIGS[name], **changes).validate()


def layer_activation_bytes(
    config: GPTConfig, batch: int, *, tp: int = 1, sequence_parallel: bool = False, value_bytes: int = 4,
    mask_bytes: int = 1,
) -> float:  # fmt: skip
    """Bytes one layer saves for backward on each rank, by the formula above (dropout on)."""
    return layer_saved_bytes(
        config.seq_len, batch, config.hidden, config.heads, t=tp, sp=sequence_parallel,
        value_bytes=value_bytes, mask_bytes=mask_bytes,
    )  # fmt: skip
