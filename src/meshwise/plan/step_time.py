"""Seconds per optimizer step of a layout, by cause: compute, the head, TP, CP and EP collectives, pipeline
bubble and point-to-point, data-parallel reduction (what backward does not hide), ZeRO-3 gathers,
optimizer, and the step's scalar all-reduces.

- **Compute**: FLOPs per token (6N_active + attention, recomputation counted: hardware FLOPs) × tokens of
  the rank's share (÷ cp), over peak × the matmul efficiency at the layer's largest GEMM (b·s/cp × h × 4h/t)
  — on ``cpu`` a tp rank's own shard's measured curve (:mod:`meshwise.plan.block_time`).
- **Head**: where the hardware measured it (``cpu``, :mod:`meshwise.plan.head_time`), the embeddings,
  final LayerNorm, head and loss of each micro-batch at their measured cost (÷ t: the head is
  vocabulary-parallel), on the last pipeline stage — and the head's 6·V·h FLOPs leave the compute term;
  elsewhere they stay in it.
- **TP**: every call the tp group makes per micro-batch (:mod:`meshwise.plan.calls`, counted from the
  code), each priced alone; on the critical path (no overlap). On ``cpu`` every call is also a meeting of
  the group between slices of compute (:mod:`meshwise.plan.rendezvous`), as are CP's and EP's calls.
- **CP**: the attention's all-gather of keys and values per layer forward, the re-gather and the
  gradients' reduce-scatter backward (:func:`context_parallel_seconds`).
- **EP**: dispatch and combine all-to-alls per MoE layer, forward and backward (:func:`expert_seconds`).
- **Pipeline**: compute + TP stretched by 1/(1 − bubble), bubble = (p−1)/(v·m + p−1) (the simulator's
  figure) — on a host whose ranks' threads outnumber the cores, less what the idle stages' cores give
  the busy ones (:func:`bubble_seconds`), plus one activation (forward) and one gradient (backward)
  transfer on the critical path per micro-batch and chunk, and for the fill and drain.
- **Data parallel**: the gradients of one rank (b_g·Ψ_rank bytes) summed over dp·ep·cp with the cost
  model's cheapest of ring and tree — hierarchical when the group spans nodes, DDP's buckets call by call
  where the all-reduce was measured (``cpu``); ZeRO-1/2 reduce-scatter each group and all-gather the
  updated weights, ZeRO-3 all-gathers each unit's weights for forward and backward and reduce-scatters its
  gradients every micro-batch. Buckets overlap with the last micro-batch's backward (ZeRO-3's gathers with
  every micro-batch's compute) where a core is free to progress them (:meth:`Hardware.overlaps`); only
  the part longer than that, or at least the last bucket, is exposed.
- **Optimizer**: memory-bound, every byte of state read and written once at the memory bandwidth; or,
  where the hardware measured it (``cpu``: an AdamW step with clipping and ``zero_grad`` over one block),
  that time per parameter times the parameters this rank updates (Ψ_rank/dp under ZeRO).
- **Sync**: the two scalars every step all-reduces whatever the layout — the loss over the replicas
  (dp·ep·cp) and the gradient norm for clipping over every rank — each one call; on ``cpu`` the latter
  is also a meeting of every rank after the step's compute (:func:`step_meeting`).

A call costs what the hardware measured for that collective on that many ranks (``cpu``:
:mod:`meshwise.plan.gloo_calls`), else :func:`meshwise.comm.algorithms.registry.predict_seconds` with the
link's α, β and γ (the device's memory bandwidth reduces): the formulas ``meshwise bench`` is checked
against.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

from meshwise.comm.algorithms import registry
from meshwise.comm.cost.formulas import LinkParams
from meshwise.plan.calls import tensor_parallel_calls
from meshwise.plan.hardware import Hardware
from meshwise.plan.layout import Layout
from meshwise.plan.memory import BUCKET_BYTES, Precision, rank_parameters, sharded_states
from meshwise.plan.model import ModelSpec


@dataclass(frozen=True)
class TimeEstimate:
    """Seconds of one step by cause, and the throughput they give."""

    compute: float
    tensor_parallel: float
    bubble: float
    pipeline_p2p: float
    data_parallel: float  # exposed
    optimizer: float
    tokens: int  # per step, all ranks
    model_flops: float  # per step, all ranks
    hardware_flops: float
    peak: float  # FLOP/s, all ranks
    context_parallel: float = 0.0  # the attention's key/value gathers and their gradients
    expert_parallel: float = 0.0  # the MoE layers' all-to-alls
    head: float = 0.0  # embeddings, final LayerNorm, head and loss where measured (else in compute)
    sync: float = 0.0  # the loss's and the gradient norm's all-reduces

    @property
    def step(self) -> float:
        return sum(self.causes().values())

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.step

    @property
    def mfu(self) -> float:
        return self.model_flops / self.step / self.peak

    @property
    def hfu(self) -> float:
        return self.hardware_flops / self.step / self.peak

    def days(self, tokens: float) -> float:
        return tokens / self.tokens_per_second / 86400

    def causes(self) -> dict[str, float]:
        return {
            k: getattr(self, k)
            for k in (
                "compute",
                "head",
                "tensor_parallel",
                "context_parallel",
                "expert_parallel",
                "bubble",
                "pipeline_p2p",
                "data_parallel",
                "optimizer",
                "sync",
            )
        }

    def to_json(self) -> dict:
        return asdict(self) | {
            "step": self.step,
            "tokens_per_second": self.tokens_per_second,
            "mfu": self.mfu,
            "hfu": self.hfu,
        }


@functools.lru_cache(maxsize=4096)
def predict_seconds(
    collective: str, algo: str, nbytes: float, ranks: int, link: LinkParams, **two_links: object
) -> float:
    """The cost model's time of one call, remembered: a search prices the same calls thousands of times."""
    return registry.predict_seconds(collective, algo, nbytes, ranks, link, **two_links)


def call_seconds(hw: Hardware, collective: str, nbytes: float, ranks: int, inter_node: bool) -> float:
    """One call: the cost measured for that collective on that many ranks where ``hw`` has one (``cpu``),
    else the ring formula on the link (GPU presets: NCCL's rings; pairwise exchange for all-to-all)."""
    if ranks == 1:
        return 0.0
    measured = hw.call_cost(collective, ranks)
    if measured is not None:
        return measured.seconds(nbytes)
    algo = "pairwise" if collective == "all_to_all" else "ring"
    return predict_seconds(collective, algo, nbytes, ranks, hw.link_params(inter_node))


def bucket_calls(nbytes: float, ranks: int, hw: Hardware, collective: str, inter_node: bool) -> float:
    """``nbytes`` sent as DDP-sized buckets (a small first one, then :data:`BUCKET_BYTES` each): every
    bucket pays the call's latency, the bytes their bandwidth once."""
    calls = -(-int(nbytes) // BUCKET_BYTES) + 1
    return calls * call_seconds(hw, collective, nbytes / calls, ranks, inter_node)


def dp_layout(layout: Layout, hw: Hardware) -> tuple[int, bool]:
    """(dp ranks per node, whether the dp group spans nodes): ranks are numbered tp fastest, then dp, then
    pp (Megatron's order), so a node holds per_node/tp consecutive members of each dp group."""
    local = max(1, hw.per_node // layout.tp) if layout.tp <= hw.per_node else 1
    local = min(local, layout.dp)
    return local, layout.dp > local


def all_reduce_seconds(nbytes: float, ranks: int, hw: Hardware, local: int, spans: bool) -> float:
    """The cheapest of ring and tree on the dp group's link, and hierarchical when it spans nodes; where
    the all-reduce was measured on this many ranks (``cpu``), DDP's buckets at the measured cost."""
    if ranks == 1:
        return 0.0
    if hw.call_cost("all_reduce", ranks) is not None:
        return bucket_calls(nbytes, ranks, hw, "all_reduce", spans)
    link = hw.link_params(spans)
    options = [predict_seconds("all_reduce", algo, nbytes, ranks, link) for algo in ("ring", "tree")]
    if spans and local > 1 and ranks % local == 0:
        options.append(
            predict_seconds(
                "all_reduce",
                "hierarchical",
                nbytes,
                ranks,
                hw.link_params(False),
                inter=hw.link_params(True),
                local_size=local,
            )
        )
    return min(options)


def estimate_time(
    model: ModelSpec, layout: Layout, hw: Hardware, precision: Precision, global_batch: int
) -> TimeEstimate:
    c = model.config
    s, b, h, t, p, v = c.seq_len, layout.micro_batch, c.hidden, layout.tp, layout.pp, layout.virtual
    m = layout.micro_batches(global_batch)
    tokens = global_batch * s
    hardware_per_token = model.flops_per_token(layout.recompute)
    peak = hw.peak(precision.dtype)
    cp = layout.cp
    compute_mb = block_seconds(model, layout, hw, peak)
    head_mb = hw.head.seconds(b * s / cp) / t if hw.head is not None else 0.0
    tp_inter = t > hw.per_node
    tp_calls = tensor_parallel_calls(model, layout, precision)
    tp_mb = sum(call.count * call_seconds(hw, call.collective, call.nbytes, t, tp_inter) for call in tp_calls)
    tp_mb += hw.meetings(t, sum(call.count for call in tp_calls), compute_mb + head_mb)
    activation = b * s * h * precision.value
    cp_mb, ep_mb = (
        context_parallel_seconds(model, layout, hw, precision, compute_mb),
        expert_seconds(model, layout, hw, precision, compute_mb),
    )
    busy = m * (compute_mb + head_mb + tp_mb + cp_mb + ep_mb)
    shared = hw.share if hw.oversubscribed(layout.gpus) else 1.0  # else an idle stage's core helps no rank
    bubble = bubble_seconds(busy, layout.bubble(global_batch), shared)
    p2p = 0.0
    if p > 1:
        spans_nodes = t * layout.dp >= hw.per_node
        link = hw.link_params(spans_nodes)
        message = link.alpha + link.beta * activation / (t if layout.sp else 1)
        p2p = 2 * (v * m + p - 1) * message
    dp_seconds = _data_parallel(model, layout, hw, precision, m, compute_mb)
    states = sharded_states(model, layout, precision)
    optimizer = 2 * sum(states) / hw.memory_bandwidth
    if hw.optimizer_seconds is not None:  # per parameter the rank steps: its optimizer state's share
        optimizer = hw.optimizer_seconds * states[2] / precision.optimizer_bytes
    return TimeEstimate(
        compute=m * compute_mb,
        tensor_parallel=m * tp_mb,
        bubble=bubble,
        pipeline_p2p=p2p,
        data_parallel=dp_seconds,
        optimizer=optimizer,
        tokens=tokens,
        model_flops=model.flops_per_token() * tokens,
        hardware_flops=hardware_per_token * tokens,
        peak=peak * layout.gpus,
        context_parallel=m * cp_mb,
        expert_parallel=m * ep_mb,
        head=m * head_mb,
        sync=sync_seconds(layout, hw) + step_meeting(layout, hw, m * (compute_mb + head_mb)),
    )


def step_meeting(layout: Layout, hw: Hardware, compute: float) -> float:
    """Every rank meets the others once a step (the gradient norm's all-reduce) after ``compute`` seconds
    of its own: priced as a meeting of all the ranks (:meth:`Hardware.meetings`, ``cpu``), unless a
    group of all of them already meets between the layers (tp, cp or ep spanning every rank)."""
    if max(layout.tp, layout.cp, layout.ep) >= layout.gpus:
        return 0.0
    return hw.meetings(layout.gpus, 1, compute)


def bubble_seconds(busy: float, idle: float, share: float = 1.0) -> float:
    """The pipeline's idle time beyond a rank's ``busy`` seconds, ``idle`` its idle fraction: the busy
    time stretched by 1/(1 − idle) — where each rank has its device. Where the ranks share cores
    (``share`` < 1: each runs at that fraction of its alone speed while all compute), a stage waiting in
    the bubble hands its share of the cores to the stages that work, which then run faster: the step is
    the critical path at the alone speed, busy·share/(1 − idle), or every rank's work at the shared speed,
    whichever is longer."""
    return max(0.0, busy * share / (1 - idle) - busy)


def block_seconds(model: ModelSpec, layout: Layout, hw: Hardware, peak: float) -> float:
    """Seconds of one micro-batch through the rank's blocks (and, where the head is not measured apart,
    the head's FLOPs): the FLOPs a rank is charged over peak × the efficiency of its tp shard's curve
    (:meth:`Hardware.block_efficiency`) at its largest GEMM (b·s/cp × h × 4h/t), recomputation counted."""
    c = model.config
    b, s, h, t, cp = layout.micro_batch, c.seq_len, c.hidden, layout.tp, layout.cp
    gemm = 2 * b * s / cp * h * 4 * h / t
    rate = peak * hw.block_efficiency(t, layout.sp).at(gemm)
    per_token = model.flops_per_token(layout.recompute)
    per_token -= model.head_flops_per_token if hw.head is not None else 0.0
    return per_token * b * s / (t * layout.pp * cp) / rate


def sync_seconds(layout: Layout, hw: Hardware) -> float:
    """The step's two scalar all-reduces (float64): the loss over the replicas, the gradient norm over all
    ranks; nothing where either group is one rank."""
    inter = layout.gpus > hw.per_node
    return call_seconds(hw, "all_reduce", 8, layout.replicas, inter) + call_seconds(
        hw, "all_reduce", 8, layout.gpus, inter
    )


def context_parallel_seconds(
    model: ModelSpec, layout: Layout, hw: Hardware, precision: Precision, compute: float = 0.0
) -> float:
    """Context-parallel attention per micro-batch, as :mod:`meshwise.parallel.context_parallel.attention`
    runs it (an all-gather design, not a ring): in each layer's forward one all-gather of the keys and
    values (2·b·s·h/t values, all slots); in backward the fused kernel gathers them again and the
    gradients go back by one reduce-scatter; full recomputation repeats the forward's gather. Each call
    is a meeting of the cp group between slices of the micro-batch's ``compute`` seconds
    (:meth:`Hardware.meetings`)."""
    if layout.cp == 1:
        return 0.0
    c = model.config
    nbytes = 2 * layout.micro_batch * c.seq_len * c.hidden / layout.tp * precision.value
    inter = layout.gpus > hw.per_node
    gathers = 3 if layout.recompute == "full" else 2
    per_layer = gathers * call_seconds(hw, "all_gather", nbytes, layout.cp, inter)
    per_layer += call_seconds(hw, "reduce_scatter", nbytes, layout.cp, inter)
    layers = -(-c.layers // layout.pp)
    return layers * per_layer + hw.meetings(layout.cp, layers * (gathers + 1), compute)


def expert_seconds(
    model: ModelSpec, layout: Layout, hw: Hardware, precision: Precision, compute: float = 0.0
) -> float:
    """The MoE layers' token exchange per micro-batch: dispatch and combine all-to-alls of each rank's
    b·(s/cp)·k token copies of h values, forward and again in backward (4 per layer; 6 with full
    recomputation), over the ep ranks at the all-to-all's cost, each a meeting of the ep group between
    slices of the micro-batch's ``compute`` seconds (:meth:`Hardware.meetings`)."""
    c = model.config
    if layout.ep == 1 or not c.experts:
        return 0.0
    nbytes = layout.micro_batch * c.seq_len / layout.cp * c.top_k * c.hidden * precision.value
    calls = 6 if layout.recompute == "full" else 4
    one = call_seconds(hw, "all_to_all", nbytes, layout.ep, layout.gpus > hw.per_node)
    layers = -(-c.layers // layout.pp)
    return layers * calls * one + hw.meetings(layout.ep, layers * calls, compute)


def _data_parallel(
    model: ModelSpec, layout: Layout, hw: Hardware, precision: Precision, m: int, compute_mb: float
) -> float:
    """Exposed seconds of the dp group's communication per step (see the module docstring)."""
    dp = layout.replicas  # dense gradients are summed over dp, and over ep and cp ranks too
    if dp == 1:
        return 0.0
    local, spans = dp_layout(layout, hw)
    nbytes = precision.value * rank_parameters(model, layout)
    # a rank's threads filling the host's cores leave none to progress the collective during backward
    backward = compute_mb * 2 / 3 if hw.overlaps(layout.gpus) else 0.0
    layers = -(-model.config.layers // layout.pp)
    if layout.zero == 3:
        # every layer unit's two groups (decayed and not) gathered before its forward and its backward and
        # reduce-scattered after its backward, the root's two groups once
        units = 2 * layers + 2
        per_byte = nbytes / units
        gathers = (2 * units - 2) * call_seconds(hw, "all_gather", per_byte, dp, spans)
        per_mb = gathers + units * call_seconds(hw, "reduce_scatter", per_byte, dp, spans)
        first_unit = per_mb / units
        hidden = compute_mb if hw.overlaps(layout.gpus) else 0.0
        return m * max(per_mb - hidden, first_unit)
    if layout.zero:
        # groups are DDP's buckets split by weight decay: a reduce-scatter each, and an all-gather of the
        # updated weights after the step
        total = 2 * bucket_calls(nbytes / 2, dp, hw, "reduce_scatter", spans)
        total += 2 * bucket_calls(nbytes / 2, dp, hw, "all_gather", spans)
        hidden = min(backward, total / 2)
    else:
        total = all_reduce_seconds(nbytes, dp, hw, local, spans)
        hidden = backward
    last_bucket = total * min(1.0, BUCKET_BYTES / nbytes)
    return max(total - hidden, last_bucket)
