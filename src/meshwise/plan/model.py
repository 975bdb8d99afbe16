"""The model a plan sizes: a GPT shape, its parameter count and its FLOPs per token.

Counts are Narayanan et al. 2021's (Eq. 2): ``P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))`` — the
blocks' matrices and biases, the token and position embeddings, the head tied to the token embedding —
which our :class:`~meshwise.models.gpt.GPT` has exactly, plus its final LayerNorm (2h). ``--params N``
picks a shape: the published configuration of Narayanan et al.'s Table 1 nearest in size (its hidden
size and heads, and its layers when it is within 2 % of N, else the layers whose count comes closest);
the model states are then priced with N itself (as the ZeRO paper prices Ψ), the activations and FLOPs
with the shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshwise.models.gpt_shape import GPTConfig

#: Narayanan et al. 2021, Table 1: (published parameters, heads, hidden, layers); V = 51,200, s = 2048.
MEGATRON_TABLE: tuple[tuple[float, int, int, int], ...] = (
    (1.7e9, 24, 2304, 24),
    (3.6e9, 32, 3072, 30),
    (7.5e9, 32, 4096, 36),
    (18.4e9, 48, 6144, 40),
    (39.1e9, 64, 8192, 48),
    (76.1e9, 80, 10240, 60),
    (145.6e9, 96, 12288, 80),
    (310.1e9, 128, 16384, 96),
    (529.6e9, 128, 20480, 105),
    (1008.0e9, 160, 25600, 128),
)
MEGATRON_VOCAB = 51200
MEGATRON_SEQ = 2048


def narayanan_parameters(layers: int, hidden: int, vocab: int, seq_len: int) -> float:
    """Eq. 2 of Narayanan et al. 2021."""
    h = hidden
    return 12 * layers * h * h * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * layers * h))


@dataclass(frozen=True)
class ModelSpec:
    """A GPT shape and the parameter count the model states are priced with."""

    config: GPTConfig
    parameters: float  # = the shape's count, or what --params asked for

    @classmethod
    def of(cls, config: GPTConfig) -> ModelSpec:
        return cls(config.validate(), float(config.num_parameters()))

    @classmethod
    def from_parameters(
        cls,
        parameters: float,
        *,
        seq_len: int | None = None,
        vocab: int | None = None,
        heads: int | None = None,
    ) -> ModelSpec:
        if not parameters >= 1e6:
            raise ValueError(f"--params must be at least 1e6, got {parameters:g}")
        published, a, h, layers = min(MEGATRON_TABLE, key=lambda row: abs(row[0] / parameters - 1))
        s, v = seq_len or MEGATRON_SEQ, vocab or MEGATRON_VOCAB
        if abs(published / parameters - 1) > 0.02:  # else keep the table's depth (it divides into stages)
            per_layer = 12 * h * h + 13 * h
            layers = max(1, round((parameters - (v + s) * h - 2 * h) / per_layer))
        return cls(GPTConfig(layers, h, heads or a, s, v).validate(), float(parameters))

    @property
    def active_parameters(self) -> float:
        """Parameters one token uses: all of them for a dense model; the router and top-k of the E experts
        in a mixture of experts (what its FLOPs are counted with)."""
        c = self.config
        return self.parameters * c.num_parameters(active=True) / c.num_parameters()

    @property
    def layer_parameters(self) -> int:
        h = self.config.hidden
        return 12 * h * h + 13 * h

    @property
    def embedding_parameters(self) -> int:
        """Token embedding (= the tied head's matrix); the position table is counted apart."""
        return self.config.vocab * self.config.hidden

    @property
    def head_flops_per_token(self) -> float:
        """6·V·h: the tied head's matmul, forward and backward — the part of :meth:`flops_per_token` outside
        the blocks (the embedding lookups are not matmuls)."""
        return 6.0 * self.embedding_parameters

    def flops_per_token(self, recompute: str = "none") -> float:
        """Training FLOPs per token: 6N for the matmuls with the weights (N without the position table,
        a lookup) plus 12·l·h·s for QKᵀ and AV (:meth:`GPTConfig.flops_per_token`'s convention), plus what
        recomputation repeats — hardware FLOPs: full recomputation runs every block's forward again
        (2·N_blocks + 4·l·h·s), selective only the attention products (4·l·h·s)."""
        c = self.config
        attention_forward = 4 * c.layers * c.hidden * c.seq_len
        model = 6 * (self.active_parameters - c.seq_len * c.hidden) + 3 * attention_forward
        if recompute == "full":
            return model + 2 * c.layers * self.layer_parameters + attention_forward
        if recompute == "selective":
            return model + attention_forward
        return model
