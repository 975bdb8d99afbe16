"""What a training step runs outside its transformer blocks, timed on this host (the ``cpu`` preset).

The compute term prices the blocks from one block's measured forward + backward; a real step also looks
up the token and position embeddings, applies the final LayerNorm and the head, and takes the fp32
cross-entropy, forward and backward, once per micro-batch. On a GPU preset those are FLOPs like the rest
(6·V·h per token for the tied head) at the matmul efficiency; on a CPU their cost is mostly not matmul
(the gather and scatter-add of the embeddings, the log-softmax over the vocabulary, Python dispatch of a
dozen operations), so ``cpu`` times them: a micro-batch of 1 and of 4 sequences, a per-call cost and a
per-token one. Nothing here starts a process.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshwise.models.gpt_shape import GPTConfig

#: micro-batches timed: small, so that a large vocabulary's fp32 logits stay cheap to measure
MICRO_BATCHES = (1, 4)


@dataclass(frozen=True)
class HeadCost:
    """Seconds of the embeddings, final LayerNorm, head and loss of one micro-batch, forward + backward:
    ``alpha + per_token · tokens``."""

    alpha: float
    per_token: float

    def seconds(self, tokens: float) -> float:
        return self.alpha + self.per_token * tokens


def fit_head(points: dict[int, float]) -> HeadCost:
    """The line through the smallest and the largest of ``points`` (tokens → seconds); a non-positive slope
    (noise larger than the difference) is priced as cost proportional to the tokens of the largest."""
    (n0, t0), (n1, t1) = min(points.items()), max(points.items())
    slope = (t1 - t0) / (n1 - n0)
    if slope <= 0 or t0 - slope * n0 < 0:
        return HeadCost(0.0, t1 / n1)
    return HeadCost(t0 - slope * n0, slope)


def head_cost(config: GPTConfig) -> HeadCost:
    """Time the step's parts outside the blocks of ``config`` here (median runs, :data:`MICRO_BATCHES`):
    the GPT's own embedding, final LayerNorm and tied head modules, the trainer's fp32 loss."""
    import torch
    from torch import nn

    from meshwise.models.gpt import language_model_loss
    from meshwise.plan.hardware import typical_time

    torch.manual_seed(0)
    s, h, vocab = config.seq_len, config.hidden, config.vocab
    wte, wpe, ln_f = nn.Embedding(vocab, h), nn.Embedding(s, h), nn.LayerNorm(h)
    head = nn.Linear(h, vocab, bias=False)
    head.weight = wte.weight  # tied, as the GPT's
    positions = torch.arange(s)
    points = {}
    for b in MICRO_BATCHES:
        tokens = torch.randint(0, vocab, (b, s))
        targets = torch.randint(0, vocab, (b, s))

        def step(tokens: torch.Tensor = tokens, targets: torch.Tensor = targets) -> None:
            logits = head(ln_f(wte(tokens) + wpe(positions)))
            language_model_loss(logits.float(), targets).backward()

        points[b * s] = typical_time(step)
    return fit_head(points)
