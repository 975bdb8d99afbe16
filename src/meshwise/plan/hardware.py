"""The machines a plan prices: published spec-sheet figures per GPU, and ``cpu`` measured on this host.

Every figure is a *dense* (no 2:4 sparsity) peak from the vendor's datasheet (docs/plan.md cites each):
FLOP/s per dtype, memory capacity and bandwidth, the intra-node link (NVLink / Infinity Fabric, per
direction) and the inter-node link (one InfiniBand NIC per GPU, per direction), GPUs per node. Latencies
are not spec-sheet numbers: they are typical per-message costs of NCCL over each link, stated as
assumptions. Peaks are never reached: :class:`Efficiency` is the fraction of peak a matmul of a given
size achieves (a saturating curve, ``meshwise plan --calibrate`` fits it on this host).

Nothing here starts a process; ``cpu`` measures matmuls and a copy in this process.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from meshwise.comm.cost import Calibration
from meshwise.comm.cost.formulas import LinkParams
from meshwise.models.gpt_shape import GPTConfig
from meshwise.plan.gloo_calls import CallCost, measure_calls
from meshwise.plan.head_time import HeadCost, head_cost
from meshwise.plan.rendezvous import Rendezvous, measure_rendezvous

if TYPE_CHECKING:
    import torch

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class Efficiency:
    """Fraction of peak FLOP/s a matmul of ``flops`` reaches: ``best · flops / (flops + half)``, or, when
    ``table`` holds measured (flops, fraction) points, their log-linear interpolation (clamped at the
    ends) — what ``cpu`` and ``--calibrate`` measure, since a two-parameter fit is fragile on a busy host.

    Small matmuls are dominated by launch and memory traffic, large ones saturate near ``best``; ``half``
    is the size (FLOPs of one matmul) at which half of ``best`` is reached. GPU defaults: ``best`` 0.75
    (large bf16 GEMMs on A100/H100 reach 70–80 % of the datasheet peak in cuBLAS benchmarks), ``half``
    1 GFLOP (a 1024³ matmul is ~2 GFLOP and runs at roughly two thirds of the large-matrix rate)."""

    best: float = 0.75
    half: float = 1e9
    table: tuple[tuple[float, float], ...] = ()

    def at(self, flops: float) -> float:
        if not self.table:
            return self.best * flops / (flops + self.half)
        if flops <= self.table[0][0]:
            return self.table[0][1]
        for (f0, e0), (f1, e1) in zip(self.table, self.table[1:], strict=False):
            if flops <= f1:
                w = math.log(flops / f0) / math.log(f1 / f0)
                return e0 + w * (e1 - e0)
        return self.table[-1][1]


@dataclass(frozen=True)
class Link:
    """One link: bandwidth per direction (bytes/s) and latency per message (s)."""

    bandwidth: float
    latency: float

    def params(self, reduce_rate: float) -> LinkParams:
        """The cost model's α-β-γ for this link; γ is the device's rate of reducing bytes."""
        return LinkParams(alpha=self.latency, beta=1.0 / self.bandwidth, gamma=1.0 / reduce_rate)


@dataclass(frozen=True)
class Hardware:
    """One accelerator model and the links between them."""

    name: str
    peak_flops: dict[
        str, float
    ]  # dense FLOP/s by compute dtype: fp32 (TF32 tensor cores on GPUs), bf16, fp16
    memory: float  # bytes per device
    memory_bandwidth: float  # bytes/s
    intra: Link
    inter: Link
    per_node: int
    efficiency: Efficiency = field(default_factory=Efficiency)
    #: bytes a rank holds before it holds any model (runtime, allocator, CUDA context or Python + torch)
    reserved: float = 0.0
    #: whether the backend stages list-form all-gathers and reduce-scatters through one flat copy of the
    #: whole buffer (torch's gloo does, NCCL works in place): ZeRO's collectives then cost scratch memory
    collective_copies: bool = False
    #: measured seconds of one AdamW update per parameter (``cpu``: its per-element passes and per-tensor
    #: Python, on this host's threads); None: the update is priced as memory-bound traffic
    optimizer_seconds: float | None = None
    #: measured seconds of the embeddings, final LayerNorm, head and loss per micro-batch (``cpu``,
    #: :mod:`meshwise.plan.head_time`); None: the head is FLOPs in the compute term like the blocks
    head: HeadCost | None = None
    #: torch threads per rank the ``cpu`` preset was measured with (0 on GPUs): runs checked against it
    #: (``--validate``) use as many
    threads: int = 0
    #: cores of the host the ranks share (``cpu``; 0 on GPUs, whose collectives run beside the compute):
    #: where the ranks' threads fill them, no core is left to progress a collective during backward
    cores: int = 0
    #: measured per-call costs per collective and group size (``cpu``, :mod:`meshwise.plan.gloo_calls`):
    #: when one is here for a call, it prices that call instead of the link's ring formula
    calls: tuple[CallCost, ...] = ()
    #: measured efficiency of one tp rank's block per (tp, sp) degree (``cpu``,
    #: :mod:`meshwise.plan.block_time`), evaluated at the shard's own largest GEMM; a degree not here is
    #: priced with :attr:`efficiency`, as on every GPU preset
    shard_efficiency: dict[tuple[int, bool], Efficiency] = field(default_factory=dict)
    #: measured cost of a group meeting between slices of compute, per group size (``cpu``,
    #: :mod:`meshwise.plan.rendezvous`): what the per-layer calls of tp, cp and ep add beyond their
    #: back-to-back cost; none on GPUs, whose collectives are not woken by a shared scheduler
    rendezvous: dict[int, Rendezvous] = field(default_factory=dict)
    #: the fraction of its alone speed each rank keeps while all the ranks compute at once (``cpu``:
    #: :func:`rank_speedup` over the ranks, already in :attr:`peak_flops`; other jobs' load included);
    #: 1 on GPUs, one device each
    share: float = 1.0
    source: str = "datasheet"

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(f"{self.name} has no {dtype} peak; give --peak-tflops")
        return self.peak_flops[dtype]

    def link_params(self, inter_node: bool) -> LinkParams:
        return self._inter_params if inter_node else self._intra_params

    # the search prices tens of thousands of calls on the same two links: their α-β-γ made once
    @cached_property
    def _intra_params(self) -> LinkParams:
        return self.intra.params(self.memory_bandwidth / 3)

    @cached_property
    def _inter_params(self) -> LinkParams:
        return self.inter.params(self.memory_bandwidth / 3)

    def call_cost(self, collective: str, group: int) -> CallCost | None:
        """The measured cost of one ``collective`` call on ``group`` ranks, None where none was measured."""
        return next((c for c in self.calls if c.collective == collective and c.group == group), None)

    def overlaps(self, ranks: int) -> bool:
        """Whether ``ranks`` ranks leave a core to progress a collective while backward computes: always
        on a GPU; on a CPU only when their threads do not already fill the cores."""
        return self.cores == 0 or ranks * max(self.threads, 1) < self.cores

    def oversubscribed(self, ranks: int) -> bool:
        """Whether ``ranks`` ranks' threads outnumber the host's cores (``cpu``): only then does a rank
        that waits leave a core that another rank can use (never on a GPU, one device per rank)."""
        return self.cores > 0 and ranks * max(self.threads, 1) > self.cores

    def meetings(self, group: int, syncs: float, compute: float) -> float:
        """Seconds a group of ``group`` ranks loses meeting ``syncs`` times over ``compute`` seconds of
        compute, where measured (``cpu``); nothing elsewhere."""
        rendezvous = self.rendezvous.get(group)
        return rendezvous.seconds(syncs, compute) if rendezvous is not None and group > 1 else 0.0

    def block_efficiency(self, tp: int, sp: bool) -> Efficiency:
        """The curve a tp rank's block runs at: its shard's measured one where there is one, else the
        whole block's (``tp`` 1, and every degree on a GPU preset)."""
        return self.shard_efficiency.get((tp, sp), self.efficiency)


def _gpu(
    name: str,
    bf16: float,
    tf32: float,
    memory_gb: float,
    hbm_tbs: float,
    intra_gbs: float,
    inter_gbs: float,
    per_node: int = 8,
) -> Hardware:
    tflops = 1e12
    return Hardware(
        name=name,
        peak_flops={"bf16": bf16 * tflops, "fp16": bf16 * tflops, "fp32": tf32 * tflops},
        memory=memory_gb * GB,
        memory_bandwidth=hbm_tbs * 1e12,
        intra=Link(intra_gbs * GB, 5e-6),
        inter=Link(inter_gbs * GB, 1e-5),
        per_node=per_node,
        # a CUDA context, NCCL's buffers and the caching allocator's fragmentation: ~2 GB in practice
        reserved=2 * GB,
    )


#: Datasheet figures (docs/plan.md#hardware cites each): dense bf16 and TF32 TFLOP/s, memory GB, memory
#: TB/s, intra-node GB/s per direction (NVLink 3: 600 GB/s total → 300; NVLink 4: 900 → 450; MI300X: 7
#: Infinity Fabric links of 64 GB/s per direction), inter-node GB/s per GPU (HDR 200 Gb/s, NDR 400 Gb/s).
PRESETS: dict[str, Hardware] = {
    "a100-40gb": _gpu("a100-40gb", 312.0, 156.0, 40, 1.555, 300, 25),
    "a100-80gb": _gpu("a100-80gb", 312.0, 156.0, 80, 2.039, 300, 25),
    "h100-sxm": _gpu("h100-sxm", 989.4, 494.7, 80, 3.35, 450, 50),
    "h200": _gpu("h200", 989.4, 494.7, 141, 4.8, 450, 50),
    "mi300x": _gpu("mi300x", 1307.4, 653.7, 192, 5.3, 448, 50),
}
CPU = "cpu"
NAMES = (*PRESETS, CPU)


def hardware(name: str) -> Hardware:
    """The preset ``name``; ``cpu`` is measured now (a second or so)."""
    if name == CPU:
        return measure_cpu()
    if name not in PRESETS:
        raise ValueError(f"unknown --gpu {name!r}; choose one of {', '.join(NAMES)}")
    return PRESETS[name]


def with_overrides(
    hw: Hardware,
    *,
    tflops: float | None = None,
    dtype: str = "bf16",
    memory_gb: float | None = None,
    intra_gbs: float | None = None,
    inter_gbs: float | None = None,
    intra_us: float | None = None,
    inter_us: float | None = None,
    per_node: int | None = None,
) -> Hardware:
    """``hw`` with any given flag replacing its figure (each flag is one field, in the flag's unit)."""
    changes: dict = {}
    if tflops is not None:
        changes["peak_flops"] = {**hw.peak_flops, dtype: tflops * 1e12}
    if memory_gb is not None:
        changes["memory"] = memory_gb * GB
    if per_node is not None:
        changes["per_node"] = per_node
    for attr, gbs, us in (("intra", intra_gbs, intra_us), ("inter", inter_gbs, inter_us)):
        link = getattr(hw, attr)
        if gbs is not None or us is not None:
            changes[attr] = Link(
                gbs * GB if gbs is not None else link.bandwidth, us * 1e-6 if us is not None else link.latency
            )
    for name, value in changes.items():
        if isinstance(value, (int, float)) and value <= 0:
            raise ValueError(f"hardware override {name} must be positive, got {value}")
    return replace(hw, **changes) if changes else hw


# ---------------------------------------------------------------------------------------- this host
def timings(work: Callable[[], object], seconds: float = 0.2, least: int = 5) -> list[float]:
    """Seconds of at least ``least`` calls of ``work`` over about ``seconds``, after a warm-up."""
    work()
    times, deadline = [], time.perf_counter() + seconds
    while len(times) < least or time.perf_counter() < deadline:
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return times


def best_time(work: Callable[[], object], seconds: float = 0.2) -> float:
    """The fastest call: what the hardware does when the job has the cores to itself (the peak)."""
    return min(timings(work, seconds))


def typical_time(work: Callable[[], object], seconds: float = 0.3) -> float:
    """The median call: on a host shared with other jobs, what a training step will also see."""
    return statistics.median(timings(work, seconds))


def matmul_rate(size: int, device: str = "cpu", dtype: str = "fp32", seconds: float = 0.15) -> float:
    """Best FLOP/s of ``size``³ matmuls on ``device`` (:func:`best_time` of them)."""
    import torch

    kind = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    a = torch.randn(size, size, device=device, dtype=kind)
    b = torch.randn(size, size, device=device, dtype=kind)

    def multiply() -> None:
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()

    return 2 * size**3 / best_time(multiply, seconds)


def fit_efficiency(points: dict[float, float], peak: float) -> Efficiency:
    """The measured curve: ``points`` maps a GEMM size (FLOPs) to the FLOP/s reached there."""
    return Efficiency(
        best=max(points.values()) / peak, table=tuple((f, r / peak) for f, r in sorted(points.items()))
    )


def shard_curves(
    config: GPTConfig, ranks: int, peak: float, whole: dict[float, float]
) -> dict[tuple[int, bool], Efficiency]:
    """One tp rank's block measured now against the whole block's rates ``whole``
    (:func:`meshwise.plan.block_time.shard_rates`) for every tp degree above 1 that ``ranks`` and the
    heads allow, with and without sp; none for a mixture of experts (its experts stay whole under tp,
    the curve of the whole block prices it)."""
    from meshwise.plan.block_time import shard_rates

    if config.experts:
        return {}
    curves = {}
    for tp in (d for d in range(2, ranks + 1) if ranks % d == 0 and config.heads % d == 0):
        for sp in (False, True) if config.seq_len % tp == 0 else (False,):
            curves[tp, sp] = fit_efficiency(shard_rates(config, tp, sp, whole), peak)
    return curves


def _block_step(config: GPTConfig | None) -> Callable[[], object]:
    """One rank's unit of work: forward + backward of one block of ``config`` at micro-batch 4 (a 256³
    matmul without a model)."""
    import torch

    if config is None:
        a = torch.randn(256, 256)
        return lambda: a @ a
    from meshwise.models.gpt import Block

    block = Block(config)
    x = torch.randn(4, config.seq_len, config.hidden, requires_grad=True)
    return lambda: block(x).sum().backward()


def clip_as_trained(grads: list[torch.Tensor], max_norm: float = 1.0) -> None:
    """Clipping as every ``train gpt`` layout does it on one rank
    (:func:`meshwise.parallel.placement.clip_gradients_`, which needs a job to all-reduce over): each
    gradient's squares summed in float64 — a widening copy per tensor, several times the cost of torch's
    fp32 ``clip_grad_norm_`` here — then every gradient scaled."""
    import torch

    total = torch.zeros(1, dtype=torch.float64)
    for grad in grads:
        total += grad.double().square().sum()
    coefficient = max_norm / (math.sqrt(total.item()) + 1e-6)
    for grad in grads:
        grad.mul_(min(coefficient, 1.0))


def adam_seconds(config: GPTConfig) -> float:
    """Seconds per parameter of the step's update over one block of ``config`` — clipping as trained
    (:func:`clip_as_trained`), AdamW's step and the ``zero_grad`` that drops the gradients — the median
    run: what the update costs here per parameter, Python per tensor included."""
    import torch

    from meshwise.models.gpt import Block

    block = Block(config)
    params = list(block.parameters())
    grads = [torch.randn_like(p) for p in params]
    optimizer = torch.optim.AdamW(params, lr=1e-9)

    def update() -> None:
        for p, g in zip(params, grads, strict=True):  # as backward leaves them: set, not accumulated
            p.grad = g
        clip_as_trained(grads)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return typical_time(update) / sum(p.numel() for p in params)


def calibrated(hw: Hardware, sizes: tuple[int, ...] = (256, 512, 1024, 2048, 4096)) -> Hardware:
    """``hw`` with the efficiency curve measured on this host's CUDA device (bf16), against its datasheet
    peak: what ``--calibrate`` does for a GPU preset."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"--calibrate with --gpu {hw.name} needs a CUDA device here; use --gpu cpu on a CPU")
    rates = {2.0 * n**3: matmul_rate(n, "cuda", "bf16") for n in sizes}
    return replace(hw, efficiency=fit_efficiency(rates, hw.peak("bf16")), source="datasheet, calibrated here")


def copy_rate(nbytes: int = 64 * 2**20) -> float:
    """Bytes/s of a large tensor copy here (read + write), the CPU's memory bandwidth as torch sees it."""
    import torch

    src = torch.empty(nbytes // 4)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(3):
        started = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * nbytes / (time.perf_counter() - started))
    return best


def other_runnable(samples: int = 20, every: float = 0.025) -> float:
    """Threads other jobs keep runnable on this host now: the kernel's count of runnable entities
    (``/proc/loadavg``'s fourth field, instantaneous, unlike the load averages) averaged over
    ``samples`` reads, less the reading thread itself; 0 where there is no /proc."""
    counts = []
    for _ in range(samples):
        try:
            counts.append(int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]))
        except (OSError, IndexError, ValueError):
            return 0.0
        time.sleep(every)
    return max(0.0, statistics.mean(counts) - 1)


def rank_speedup(work: Callable[[], object], ranks: int, seconds: float = 0.3) -> float:
    """How many times the work of one rank ``ranks`` ranks get done at once here, now: ``work`` run in
    ``ranks`` threads of this process together (torch releases the GIL inside its kernels) against the
    same work in one. Measured rather than derived from the cores: a host shared with other jobs may
    share its cores by thread, by process or by cgroup — under this machine's load two ranks got no more
    done than one, which counting idle cores or runnable threads had priced at twice."""
    import threading

    one = typical_time(work)
    if ranks <= 1:
        return 1.0
    calls = max(3, round(seconds / one))

    def run() -> None:
        for _ in range(calls):
            work()

    threads = [threading.Thread(target=run, daemon=True) for _ in range(ranks)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    together = time.perf_counter() - started
    return min(float(ranks), ranks * calls * one / together)


def gloo_link(calls: tuple[CallCost, ...]) -> Link | None:
    """The point-to-point link of two local ranks, from the measured 2-endpoint all-reduce: gloo's
    two-rank ring is one exchange each way, 2α + n·β, so α is half the call's and β the call's. None
    where no 2-endpoint all-reduce was measured."""
    pair = next((c for c in calls if c.collective == "all_reduce" and c.group == 2), None)
    if pair is None:
        return None
    return Link(bandwidth=1 / pair.beta, latency=max(pair.alpha / 2, 1e-7))


def rank_threads(ranks: int, cores: int, others: float) -> int:
    """Torch threads per rank: the cores split among the ranks (as ``spawn`` does), but no more than the
    cores other jobs leave free (what ``train gpt``'s thread hint advises): an OpenMP thread waiting at a
    barrier for a partner the scheduler descheduled spins away its slice, and a lone rank with 2 threads
    on a 2-core host running ~15 other threads took 20–40 s for a gpt-nano step that takes 0.3 s alone."""
    free = max(1, round(cores - others))
    return max(1, min(cores // max(ranks, 1), free))


def measure_cpu(
    ranks: int = 1, layer: GPTConfig | None = None, sizes: tuple[int, ...] = (128, 256, 512)
) -> Hardware:
    """This host as a planner sees it, measured now: the peak is the best fp32 square matmul; the
    efficiency curve comes from forward + backward of one block of ``layer`` (the model being planned)
    at a few micro-batch sizes, or from the square matmuls without one; with ``layer``, one tp rank's
    block per tp degree the ranks allow (:func:`shard_curves`), AdamW's update per parameter and the
    step's parts outside the blocks (:mod:`meshwise.plan.head_time`) are timed too, and with any model
    the cost of a group meeting between slices of compute (:mod:`meshwise.plan.rendezvous`). Memory
    from /proc/meminfo, every
    collective's per-call cost on each group size ``ranks`` allows measured now with all ``ranks`` talking
    at once (:func:`~meshwise.plan.gloo_calls.measure_calls`; the built-in calibration's link for one
    rank, which sends nothing), every core a
    "GPU" of one node. Measured with the torch threads one of ``ranks`` local ranks gets (the cores
    split among them, as ``spawn`` does: OpenMP threads competing for a core are far slower than one
    each), and scaled by the share of the work a rank gets done beside the others now
    (:func:`rank_speedup`: one block's step run by as many threads at once as there are ranks)."""
    import torch

    from meshwise.plan.block_time import block_rates
    from meshwise.runtime.memory import available_memory

    cores = os.cpu_count() or 1
    others = other_runnable()
    threads = rank_threads(ranks, cores, others)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        squares = {2.0 * n**3: matmul_rate(n) for n in sizes}
        rates = block_rates(layer) if layer is not None else squares
        shards = shard_curves(layer, ranks, max(squares.values()), rates) if layer is not None else {}
        meetings = measure_rendezvous(ranks)
        share = rank_speedup(_block_step(layer), ranks) / ranks if ranks > 1 else 1.0
        update = adam_seconds(layer) / share if layer is not None else None
        outside = head_cost(layer) if layer is not None else None
    finally:
        torch.set_num_threads(before)
    peak = max(squares.values())
    calls = measure_calls(ranks) if ranks > 1 else ()
    native = Calibration.builtin().native
    link = gloo_link(calls) or Link(bandwidth=1 / native.beta, latency=native.alpha)
    return Hardware(
        name=CPU,
        peak_flops={"fp32": peak * share, "bf16": peak * share, "fp16": peak * share},
        memory=float(available_memory() or 8 * GIB),
        memory_bandwidth=copy_rate(),
        intra=link,
        inter=link,
        per_node=max(cores, 64),
        efficiency=fit_efficiency(rates, peak),
        collective_copies=True,  # local ranks talk over gloo
        optimizer_seconds=update,
        head=HeadCost(outside.alpha / share, outside.per_token / share) if outside is not None else None,
        threads=threads,
        cores=cores,
        calls=calls,
        shard_efficiency=shards,
        rendezvous=meetings,
        share=share,
        source="measured",
    )
