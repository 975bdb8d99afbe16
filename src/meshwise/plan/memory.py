"""Bytes one rank holds at its peak, by kind: what fits, and by how much it does not.

Model states follow the ZeRO paper (Rajbhandari et al. 2020): per parameter ``b_p`` bytes of weights,
``b_g`` of gradients and ``K`` of optimizer state, the sharded ones divided by dp — mixed precision
(bf16/fp16) with Adam is 2 + 2 + 12 (fp32 master, two fp32 moments), fp32 Adam 4 + 4 + 8; SGD with
momentum keeps 4 (+4 master). Tensor parallelism divides the blocks' matrices, the column-parallel
biases and the vocabulary-parallel embedding by tp; LayerNorms, row-parallel biases and the position
table are replicated. A pipeline rank holds ⌈layers/pp⌉ blocks, the first the embeddings, the last the
final LayerNorm and (pp > 1) its own copy of the tied head.

Activations per layer are Korthikanti et al. 2022's, written for any value size ``v`` and mask size
``m`` (:func:`meshwise.models.gpt_shape.layer_activation_bytes`; 34·sbh + 5·as²b at 16
bits with dropout), then

- a fused ("flash") attention kernel saves its output and one fp32 log-sum-exp per row instead of the
  s×s scores: ``as²b(2v + m)`` becomes ``sbh·v + 4·asb`` (CPU SDPA without dropout does this);
- selective recomputation drops the s² terms (34·sbh/t with SP); full recomputation keeps the layer
  input only (2·sbh, /t with SP) — and either brings one layer's dropped part back while backward
  recomputes that layer (one layer at a time);

times the layers of a chunk times the chunks in flight on the first pipeline rank
(:meth:`Layout.in_flight`). The loss holds the logits and their log-softmax in fp32 (2·4·sbV/t) for
one micro-batch. ZeRO-3 gathers two blocks' weights at a time (the one running and the prefetched
next) and holds one block's full gradients before its reduce-scatter; ZeRO-2's groups are DDP's
buckets (25 MiB), two of them unsharded in flight — and it accumulates a step's micro-batches unsharded
and reduce-scatters once, so with more than one micro-batch it holds the full b_g·Ψ until then; DDP's
buckets are views of the gradients (gradient_as_bucket_view), so they cost nothing more.

Context parallelism (:mod:`meshwise.parallel.context_parallel.attention`) gathers the whole sequence's
keys and values in every layer: the fused CPU kernel keeps only the rank's own (what the per-layer
formula already counts, at s/cp) and gathers them again in backward, so one layer at a time holds the
gathered ``2·b·s·h/t`` values twice — the all-gather's output and its copy reordered into sequence order
(in backward: the re-gathered copy and its gradient) — in ``gather_buffers``; the explicit-mask path
(``attention="math"``: other devices, attention dropout) keeps each layer's gathered copy for backward.

Activations and gradients are not always alive together. With one micro-batch per step and gradients
made afresh each step (``zero_grad(set_to_none=True)``, no data-parallel buffer that keeps them: no
replicas — dp = cp = ep = 1, since cp and ep ranks average gradients through the same reducer),
backward frees each layer's activations as it makes that layer's gradients, so the step's peak holds
the larger of the two, not their sum: ``released`` = min(activations + logits, gradients) comes off the
total. With more micro-batches the first one's gradients are alive through the next one's forward.

Where the backend copies collective buffers (``Hardware.collective_copies``: torch's gloo stages a
list-form all-gather's output and reduce-scatter's input through one flat tensor of the whole buffer, and
an in-place all-gather's source is cloned first):

- ZeRO-1/2 all-gather every group's updated shard at once after the optimizer step — ``after_step`` is
  what that phase holds beyond the backward's peak: b_p·Ψ·(1 + 1/N) scratch with the model states
  (stage 1's reduced gradient shard freed, activations gone);
- ZeRO-3 keeps two units' reduce-scatters in flight (:data:`ZERO_REDUCES_IN_FLIGHT`), each a flat copy
  of the unit's gradients and its reduced slice: 2·b_g·Ψ_layer·(1 + 1/N) in ``comm_buckets``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from meshwise.models.gpt_shape import GPTConfig, layer_activation_bytes
from meshwise.plan.hardware import GIB, Hardware
from meshwise.plan.layout import Layout
from meshwise.plan.model import ModelSpec

#: DDP's bucket cap (torch's default): how much of the gradient reduction the last bucket leaves exposed
BUCKET_BYTES = 25 * 2**20
#: reduce-scatters ZeRO-2/3 keep in flight (meshwise.parallel.zero.grads.MAX_IN_FLIGHT)
ZERO_REDUCES_IN_FLIGHT = 2
OPTIMIZERS = ("adam", "sgd")


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of state, from the compute dtype and the optimizer."""

    dtype: str = "bf16"
    optimizer: str = "adam"

    def __post_init__(self) -> None:
        if self.dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"--dtype must be fp32, bf16 or fp16, got {self.dtype!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")

    @property
    def value(self) -> int:
        return 4 if self.dtype == "fp32" else 2

    @property
    def optimizer_bytes(self) -> int:
        """K: optimizer state per parameter, the fp32 master copy included when weights are 16-bit."""
        moments = 8 if self.optimizer == "adam" else 4
        return moments + (0 if self.dtype == "fp32" else 4)


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes on the fullest rank, by kind."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    gather_buffers: float
    comm_buckets: float
    reserved: float
    capacity: float
    released: float = 0.0  # activations freed before the gradients replacing them exist (see above)
    after_step: float = 0.0  # what the phase after the optimizer step holds beyond backward's peak

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return (
            self.model_states
            + self.activations
            + self.logits
            + self.gather_buffers
            + self.comm_buckets
            + self.reserved
            - self.released
            + self.after_step
        )

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    @property
    def largest(self) -> str:
        parts = {k: v for k, v in asdict(self).items() if k not in ("capacity", "reserved", "released")}
        return max(parts, key=parts.__getitem__).replace("_", " ")

    def verdict(self) -> str:
        if self.fits:
            return f"fits, {(self.capacity - self.total) / GIB:.1f} GiB to spare"
        return f"out of memory by {(self.total - self.capacity) / GIB:.1f} GiB: {self.largest}"

    def to_json(self) -> dict:
        return asdict(self) | {"total": self.total, "fits": self.fits, "model_states": self.model_states}


def rank_parameters(model: ModelSpec, layout: Layout) -> float:
    """Parameters on the fullest rank (first or last pipeline stage) after TP and the pipeline split; a
    mixture of experts' MLP is its router and E/ep whole experts (experts are not split by tp)."""
    return sum(rank_parameter_kinds(model, layout))


def rank_parameter_kinds(model: ModelSpec, layout: Layout) -> tuple[float, float]:
    """:func:`rank_parameters` as (dense, experts): the two kinds ZeRO shards over different ranks."""
    c, t = model.config, layout.tp
    h = c.hidden
    per_layer = 12 * h * h / t + 7 * h / t + 6 * h
    experts_per_layer = 0.0
    if c.experts:
        dense_mlp = 8 * h * h + 5 * h
        per_layer += h * c.experts - (8 * h * h / t + 4 * h / t + h)  # the router for the tp MLP
        experts_per_layer = c.experts // layout.ep * dense_mlp
    layers = -(-c.layers // layout.pp)
    embedding = model.embedding_parameters / t
    first = layers * per_layer + embedding + c.seq_len * h
    last = layers * per_layer + 2 * h + embedding
    scale = model.parameters / c.num_parameters()  # --params: states priced with the count asked for
    dense = max(first, last) if layout.pp > 1 else first + 2 * h
    return dense * scale, layers * experts_per_layer * scale


def sharded_states(model: ModelSpec, layout: Layout, precision: Precision) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes on the fullest rank: ZeRO shards each kind over the
    ranks that hold it — dense parameters over their replicas (dp·ep·cp: ep and cp ranks hold the same
    dense weights), a rank's experts over theirs (dp·cp: the ep ranks hold other experts)."""
    dense, experts = rank_parameter_kinds(model, layout)
    kinds = (
        model_states(dense, layout.replicas, layout.zero, precision),
        model_states(experts, layout.dp * layout.cp, layout.zero, precision),
    )
    return tuple(a + b for a, b in zip(*kinds, strict=True))  # type: ignore[return-value]


def layer_activations(
    config: GPTConfig,
    micro_batch: int,
    layout: Layout,
    precision: Precision,
    *,
    attention: str = "math",
    mask_bytes: int = 0,
) -> float:
    """Bytes one layer keeps for backward per micro-batch on one rank (see the module docstring). Under
    context parallelism a rank holds s/cp of each sequence: every term is its share (the fused attention
    keeps only the rank's own keys and values and gathers the others' again in backward); a mixture of
    experts keeps each token's MLP activations (fc input, fc output, GELU output: 9·sbh values) once per
    expert it visits (top-k)."""
    s, b, h, a, t = config.seq_len, micro_batch, config.hidden, config.heads, layout.tp
    v, m = precision.value, mask_bytes
    shard = (t if layout.sp else 1) * layout.cp
    if layout.recompute == "full":
        return s * b * h * v / shard
    base = layer_activation_bytes(config, b, tp=t, sequence_parallel=layout.sp, value_bytes=v, mask_bytes=m)
    scores = a * s * s * b * (2 * v + m) / t
    if config.experts:
        base += (config.top_k - 1) * 9 * s * b * h * v
    if layout.recompute == "selective":
        return (base - scores) / layout.cp
    if attention == "flash":
        return (base - scores + (s * b * h * v + 4 * a * s * b) / t) / layout.cp
    return base / layout.cp


def context_parallel_buffers(
    config: GPTConfig, micro_batch: int, layout: Layout, precision: Precision, attention: str = "flash"
) -> tuple[float, float]:
    """(bytes held during one layer's attention, bytes each layer keeps for backward) of context
    parallelism's gathered keys and values — the whole sequence's ``2·b·s·h/t`` values: the fused kernel
    (``flash``) holds them twice while one layer runs (the all-gather's output and its reordered copy)
    and keeps none; the explicit-mask path keeps the reordered copy per layer, the all-gather's output
    only while the layer runs. (0, 0) without cp."""
    if layout.cp == 1:
        return 0.0, 0.0
    gathered = 2 * micro_batch * config.seq_len * config.hidden / layout.tp * precision.value
    return (2 * gathered, 0.0) if attention == "flash" else (gathered, gathered)


def estimate_memory(
    model: ModelSpec,
    layout: Layout,
    hw: Hardware,
    precision: Precision,
    global_batch: int,
    *,
    attention: str = "math",
    mask_bytes: int = 0,
) -> MemoryEstimate:
    """Peak bytes on the fullest rank of ``layout``."""
    c, dp, z = model.config, layout.replicas, layout.zero  # ZeRO's sharding ranks (dense parameters)
    params, grads, optimizer = sharded_states(model, layout, precision)
    chunk_layers = -(-c.layers // (layout.pp * layout.virtual))
    per_layer = layer_activations(
        c, layout.micro_batch, layout, precision, attention=attention, mask_bytes=mask_bytes
    )
    embedding_out = (
        c.seq_len * layout.micro_batch * c.hidden * precision.value / (layout.tp if layout.sp else 1)
    ) / layout.cp
    in_flight = layout.in_flight(global_batch)
    gathered_kv, kept_kv = context_parallel_buffers(c, layout.micro_batch, layout, precision, attention)
    activations = in_flight * (chunk_layers * (per_layer + kept_kv) + embedding_out)
    if layout.recompute != "none":  # backward re-runs one layer at a time: its dropped part is back
        kept = layer_activations(
            c, layout.micro_batch, replace(layout, recompute="none"), precision, attention=attention,
            mask_bytes=mask_bytes,
        )  # fmt: skip
        activations += kept - per_layer
    logits = 2 * 4 * c.seq_len * layout.micro_batch * c.vocab / layout.tp / layout.cp
    layer_weights = model.layer_parameters / layout.tp * precision.value
    gather = (2 * layer_weights if z == 3 and dp > 1 else 0.0) + gathered_kv
    # ZeRO-3: one unit's full gradients before its reduce-scatter; ZeRO-2: its groups are DDP's buckets,
    # two of them unsharded in flight — or, when a step has several micro-batches, all of them (it
    # accumulates them unsharded and reduce-scatters once); DDP's buckets are views of the gradients
    # (our reducer, torch's gradient_as_bucket_view), so they add nothing
    buckets = layer_weights if z == 3 and dp > 1 else 0.0
    if z == 2 and dp > 1:
        unsharded = precision.value * rank_parameters(model, layout)
        several = layout.micro_batches(global_batch) > 1
        buckets = unsharded if several else min(unsharded, ZERO_REDUCES_IN_FLIGHT * BUCKET_BYTES)
    fresh = layout.micro_batches(global_batch) == 1 and layout.replicas == 1 and layout.pp == 1
    released = min(activations + logits, grads) if fresh else 0.0
    after_step = 0.0
    if hw.collective_copies and dp > 1 and z:
        if z == 3:
            buckets += ZERO_REDUCES_IN_FLIGHT * layer_weights * (1 + 1 / dp)
        else:
            scratch = precision.value * rank_parameters(model, layout) * (1 + 1 / dp)
            kept = activations + logits + buckets - released  # what backward's peak held beyond the states
            after_step = max(0.0, scratch - kept)
    return MemoryEstimate(
        params, grads, optimizer, activations, logits, gather, buckets, hw.reserved, hw.memory, released,
        after_step,
    )  # fmt: skip


def model_states(parameters: float, dp: int, stage: int, precision: Precision) -> tuple[float, float, float]:
    """The ZeRO paper's (weights, gradients, optimizer state) bytes per rank: b_p·Ψ, b_g·Ψ and K·Ψ, the
    last ``stage`` of them (counting from the optimizer) divided by the dp ranks."""
    v, k = precision.value, precision.optimizer_bytes
    return (
        v * parameters / (dp if stage >= 3 else 1),
        v * parameters / (dp if stage >= 2 else 1),
        k * parameters / (dp if stage >= 1 else 1),
    )
