"""Each rank's peak memory during training, measured the way ``meshwise plan`` predicts it.

On a GPU a planner is checked against ``torch.cuda.max_memory_allocated``: bytes held by tensors, not
what the caching allocator reserved. A CPU has no such counter, and its resident set (``VmRSS``/
``VmHWM``) is the wrong stand-in: glibc keeps freed activation chunks in its arenas, so a gpt-nano
rank's resident set grows by tens of MiB over the first steps with no tensor more alive, and its
high-water mark also holds what the process touched before training (the whole model, built on every
rank before it is cut).

So the *allocated* bytes are measured: glibc's ``mallinfo2`` in-use heap plus mmapped chunks (every
tensor's storage is a ``malloc`` on CPU), sampled every :data:`PERIOD` seconds by a thread (the call
releases the GIL) from just before the model is built. Torch allocates ~12 MiB of its own on first use
whatever the model (lazily imported optimizer machinery, the BLAS packing buffers of a size's first
matmuls), so a one-block model of the run's width first takes a step at the run's micro-batch
(:func:`warm_up`, freed at once) and the base is read after it: what is counted is what the layout
holds, as ``max_memory_allocated`` counts tensors and not cuBLAS. Reported per rank, above that base:

- ``allocated``: the peak during the first :data:`MEASURED_STEPS` training steps (the model's states,
  activations, buffers);
- ``setup_allocated``: the peak while the model was built and cut (the whole model on every rank);
- ``resident``: the resident high-water mark during the steps (``/proc/self/clear_refs`` resets it when
  training starts) minus the resident set before the model: what the allocator's retention adds.

On CUDA the allocated figures are torch's own (reset when training starts); without ``mallinfo2`` (not
glibc) they are None.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import threading
from dataclasses import replace
from pathlib import Path

import torch

from meshwise.models.gpt import GPT, GPTConfig, language_model_loss

#: steps sampled: a step's peak is reached by the second (the optimizer's state exists after the
#: first), so sampling stops after these — a long run does not pay for the thread
MEASURED_STEPS = 5
#: seconds between samples: a step's peak (activations of every layer, the first gradients) lasts for
#: the start of backward — milliseconds even for gpt-tiny — and one sample costs tens of microseconds
PERIOD = 0.002


#: glibc's ``struct mallinfo2``: ten ``size_t`` counters, in its order
_MALLINFO2_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS.split()]


def _mallinfo2() -> ctypes._CFuncPtr | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


_MALLINFO2 = _mallinfo2()


def allocated_bytes() -> int | None:
    """Bytes malloc has handed out and not had back, this process (None without glibc's mallinfo2)."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0


def _reset_high_water() -> None:
    """Reset this process's VmHWM to its current resident set (Linux ≥ 4.0; where it is refused the
    mark keeps the setup's peak)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def warm_up(config: GPTConfig, micro_batch: int) -> None:
    """One AdamW step of a one-block ``config`` on ``micro_batch`` sequences, then nothing of it kept:
    torch's one-time allocations happen here rather than inside the measured steps."""
    model = GPT(replace(config, layers=1))
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.zeros(micro_batch, config.seq_len, dtype=torch.long)
    language_model_loss(model(tokens), tokens).backward()
    optimizer.step()
    del model, optimizer, tokens
    gc.collect()


class PeakMemory:
    """This rank's allocated bytes from construction (just before the model is built) on."""

    def __init__(self, config: GPTConfig, micro_batch: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if not self.cuda and _MALLINFO2 is not None:
            warm_up(config, micro_batch)
        self.base = torch.cuda.memory_allocated(device) if self.cuda else allocated_bytes()
        self.device = device
        self.base_resident = _status_kib("VmRSS:")
        self.peak = self.base or 0
        self.setup_peak: int | None = None
        self.result: dict[str, int | None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.base is not None and not self.cuda:
            self._thread = threading.Thread(target=self._sample, name="peak-memory", daemon=True)
            self._thread.start()

    def _now(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device)
        return allocated_bytes() or 0

    def _sample(self) -> None:
        while not self._stop.wait(PERIOD):
            self.peak = max(self.peak, self._now())

    def training_starts(self) -> None:
        """The model is built and cut: what came before is the setup peak, the steps' peak starts now."""
        now = self._now()
        self.setup_peak, self.peak = max(self.peak, now), now
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        _reset_high_water()

    def stop(self) -> dict[str, int | None]:
        """Bytes above the start: the steps' peak allocated, the setup's, and the steps' resident peak
        (measured at the first call; later calls return the same)."""
        if self.result is not None:
            return self.result
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        peak = max(self.peak, self._now())
        setup = self.setup_peak if self.setup_peak is not None else peak
        base = self.base
        self.result = {
            "allocated": None if base is None else peak - base,
            "setup_allocated": None if base is None else setup - base,
            "resident": _status_kib("VmHWM:") - self.base_resident,
        }
        return self.result
