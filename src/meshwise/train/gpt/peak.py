"""Peak FLOP/s for MFU: the datasheet figure on known GPUs, a measured matmul rate elsewhere.

MFU (model FLOPs utilisation, PaLM's definition) divides the FLOPs the model needs per second — 6N plus
the attention term per token, times tokens/s — by what the hardware could do. On a GPU that is the
vendor's dense tensor-core peak for the dtype. A CPU has no such published figure for the cores this
rank got, so the denominator is measured: the best rate of a large square matmul on this rank's threads,
at the same moment the other ranks measure theirs (so ranks sharing cores are not each credited the
whole machine), in the run's dtype and in fp32, whichever is faster.
"""

from __future__ import annotations

import time

import torch

#: Dense peak TFLOP/s by GPU name fragment: (bf16 tensor core, fp32 with TF32 tensor cores).
GPU_PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "H200": (989.4, 494.7),
    "H100": (989.4, 494.7),
    "A100": (312.0, 156.0),
    "L40S": (362.1, 181.0),
    "L4": (121.0, 60.0),
    "A10": (125.0, 62.5),
}


def measured_peak(
    device: torch.device, dtype: torch.dtype, *, size: int = 512, seconds: float = 0.5
) -> float:
    """Best FLOP/s of ``size``² matmuls: at least 5 timed after a warm-up, and about ``seconds`` of them
    (the best of several, because a rank sharing its cores is interrupted now and then)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    a @ b
    sync()
    best, deadline, runs = 0.0, time.perf_counter() + seconds, 0
    while runs < 5 or time.perf_counter() < deadline:
        started = time.perf_counter()
        a @ b
        sync()
        best = max(best, 2 * size**3 / (time.perf_counter() - started))
        runs += 1
    return best


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """This rank's peak FLOP/s and where it came from: ``"datasheet"`` for a known CUDA device (its bf16
    figure under bf16, else fp32's), ``"measured"`` elsewhere."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, (bf16, fp32) in GPU_PEAK_TFLOPS.items():
            if fragment in name:
                return (bf16 if dtype == torch.bfloat16 else fp32) * 1e12, "datasheet"
    # A CPU without bf16 matmul units runs a bare bf16 matmul far below its fp32 rate, while autocast's
    # kernels reach the fp32 rate or better; dividing by the bf16 figure reported MFU above 100 %. The
    # denominator is therefore the best rate these cores reach in either precision.
    return max(measured_peak(device, dtype), measured_peak(device, torch.float32)), "measured"


def shared_cores_peak(
    summed: float, best_per_thread: float, threads: int, cores: int
) -> tuple[float, str | None]:
    """The peak of ranks on one host that share its ``cores``: the sum of their measured peaks, but
    never more than ``cores`` threads at the best rate one thread reached. Ranks whose ``threads``
    together outnumber the cores each time a matmul in the slices the scheduler gives them, and the
    best of those is a whole core's rate: summed, the peak grew with every rank added. Returns the
    peak and, when the cores are oversubscribed, a note saying so."""
    if threads <= cores:
        return summed, None
    note = (
        f"{threads} threads over the ranks on {cores} cores: the ranks share cores (oversubscribed), so "
        f"MFU is against those {cores} cores' peak; fewer ranks (-np) or OMP_NUM_THREADS avoid the sharing"
    )
    return min(summed, best_per_thread * cores), note


def thread_hint(threads: int, cores: int, load: float) -> str | None:
    """For one rank: a hint when its OpenMP threads outnumber the cores other work leaves free
    (``load``: the 1-minute load average, which counts runnable processes)."""
    free = max(1, int(cores - load))
    if threads <= free:
        return None
    return (
        f"torch uses {threads} threads but only about {free} of {cores} cores are free (load {load:.1f}): "
        f"set OMP_NUM_THREADS={free} (threads waiting for a busy core slow every matmul)"
    )
