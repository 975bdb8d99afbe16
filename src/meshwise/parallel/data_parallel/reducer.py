"""Gradient averaging driven by autograd hooks: a bucket is reduced once its last gradient has landed.

The parameters' ``.grad`` are views into their bucket's flat buffer, so autograd accumulates straight into
what is reduced (a gradient arriving as a fresh tensor is copied into its view once, which becomes
``.grad`` again). Buckets launch strictly in plan order, so every rank issues the same all-reduces in the
same order whatever order autograd finishes them in. They launch during backward only over a communicator
whose collectives progress in the background (``Communicator.overlaps_compute``); on shm an all-reduce
completes on the calling thread, so launching mid-backward overlaps nothing and makes the ranks meet once
per bucket, paying their skew each time (gpt-nano's backward took 1.5–1.8× as long, benchmarks/RESULTS.md):
there every bucket launches when backward ends, one meeting per step.

A callback queued on the autograd engine launches what is left when backward ends and waits for every
bucket, so ``loss.backward()`` returns averaged gradients. A driver whose step's gradients arrive over
several backward calls (a pipeline stage's split backward) sets ``end_with_backward=False`` and calls
:meth:`GradReducer.flush` and :meth:`GradReducer.wait` itself, overlapping whatever it runs in between.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import nn

from meshwise.comm.api import Communicator, ReduceOp, Work
from meshwise.parallel.data_parallel.buckets import Bucket


class UnusedParametersError(RuntimeError):
    """Parameters that received no gradient in a synchronised backward (and find_unused_parameters=False)."""


class _BucketBuffer:
    """A bucket's flat gradient buffer, its per-parameter views and its in-flight all-reduce."""

    def __init__(self, plan: Bucket, params: Sequence[nn.Parameter], wire_dtype: torch.dtype | None) -> None:
        self.plan = plan
        self.flat = torch.zeros(plan.numel, dtype=plan.dtype, device=plan.device)
        self.views = [
            self.flat[offset : offset + params[i].numel()].view(params[i].shape)
            for i, offset in zip(plan.params, plan.offsets, strict=True)
        ]
        compress = wire_dtype is not None and wire_dtype != plan.dtype
        self.wire = torch.empty(plan.numel, dtype=wire_dtype, device=plan.device) if compress else None
        self.pending = len(plan.params)
        self.work: Work | None = None

    def launch(self, comm: Communicator) -> None:
        sent = self.flat if self.wire is None else self.wire.copy_(self.flat)
        self.work = comm.all_reduce(sent, ReduceOp.AVG, async_op=True)

    def wait(self) -> None:
        assert self.work is not None
        self.work.wait()
        if self.wire is not None:
            self.flat.copy_(self.wire)

    def reset(self) -> None:
        self.work = None
        self.pending = len(self.plan.params)


class GradReducer:
    """Averages the gradients of ``params`` over ``comm`` in ``buckets`` during backward."""

    def __init__(
        self,
        named_params: Sequence[tuple[str, nn.Parameter]],
        comm: Communicator,
        buckets: Sequence[Bucket],
        *,
        find_unused_parameters: bool,
        wire_dtype: torch.dtype | None,
        end_with_backward: bool = True,
    ) -> None:
        self.comm = comm
        self._end_with_backward = end_with_backward
        self._launch_during_backward = comm.overlaps_compute
        self.find_unused_parameters = find_unused_parameters
        self.sync = True  # whether the next backward averages (set by prepare at forward time)
        self._names = [name for name, _ in named_params]
        self._params = [param for _, param in named_params]
        self._buckets = [_BucketBuffer(plan, self._params, wire_dtype) for plan in buckets]
        slots = {
            position: (bucket, view)
            for bucket in self._buckets
            for position, view in zip(bucket.plan.params, bucket.views, strict=True)
        }
        self._slots = [slots[position] for position in range(len(self._params))]
        self._ready = [False] * len(self._params)
        self._usage = torch.zeros(len(self._params), dtype=torch.int32, device=buckets[0].device)
        self._next = 0
        self._queued = False
        self._flushed: tuple[list[int], Work | None] | None = None
        this = weakref.ref(self)  # hooks must not keep a discarded wrapper's reducer alive
        self._handles = [
            param.register_post_accumulate_grad_hook(_hook(this, position))
            for position, param in enumerate(self._params)
        ]

    def __del__(self) -> None:
        for handle in getattr(self, "_handles", ()):
            handle.remove()

    def prepare(self, sync: bool) -> None:
        """Called at forward: whether the coming backward averages. The state a synchronised backward that
        died half-way left (an exception drops autograd's end callback) is cleared, so the next step is
        not silently unsynchronised — after the all-reduces it launched (its peers did too) have landed."""
        if self._queued:
            for bucket in self._buckets:
                if bucket.work is not None:
                    bucket.work.wait()
            self._reset()
        self.sync = sync

    # ------------------------------------------------------------------ during backward
    def on_gradient(self, position: int) -> None:
        """A parameter's gradient was accumulated: keep it in its bucket, and launch full buckets."""
        param = self._params[position]
        bucket, view = self._slots[position]
        self._adopt(param, view)
        if not self.sync:
            return
        self._ready[position] = True
        if not self._queued:
            if self._end_with_backward:
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        bucket.pending -= 1
        if bucket.pending == 0 and self._launch_during_backward:
            self._launch_in_order()

    @staticmethod
    def _adopt(param: nn.Parameter, view: torch.Tensor) -> None:
        grad = param.grad
        if grad is not None and grad.data_ptr() != view.data_ptr():
            view.copy_(grad)
            param.grad = view

    def _launch_in_order(self) -> None:
        while self._next < len(self._buckets) and self._buckets[self._next].pending == 0:
            self._buckets[self._next].launch(self.comm)
            self._next += 1

    # ------------------------------------------------------------------ when backward ends
    def _finish(self) -> None:
        """Complete the step: parameters without a gradient count as zeros, every bucket is awaited."""
        try:
            self.flush()
        finally:
            self.wait()

    def flush(self) -> None:
        """Launch every bucket not launched yet (parameters whose hook did not fire count as they are:
        their accumulated gradient, or zeros); idempotent within a step."""
        if self._flushed is not None:
            return
        missing = self._complete_missing()
        self._launch_in_order()
        self._flushed = (missing, self._start_usage(missing) if self.find_unused_parameters else None)

    def wait(self) -> None:
        """Wait for every bucket (after :meth:`flush`), then get ready for the next step."""
        if self._flushed is None:
            self._reset()
            return
        missing, usage = self._flushed
        try:
            for bucket in self._buckets:
                if bucket.work is not None:
                    bucket.wait()
            if usage is not None:
                usage.wait()
                for position in missing:
                    if self._usage[position] > 0:  # another rank used it: the average is this rank's grad
                        self._params[position].grad = self._slots[position][1]
        finally:
            self._reset()
        if missing and not self.find_unused_parameters:
            names = ", ".join(self._names[p] for p in missing)
            raise UnusedParametersError(
                f"[rank {self.comm.rank}] these parameters received no gradient in this backward: {names}. "
                "If the model skips them on purpose, wrap it with DataParallel(..., "
                "find_unused_parameters=True); otherwise make sure the loss depends on them"
            )

    def _reset(self) -> None:
        for bucket in self._buckets:
            bucket.reset()
        self._ready = [False] * len(self._params)
        self._next = 0
        self._queued = False
        self._flushed = None

    def _complete_missing(self) -> list[int]:
        """Mark every parameter whose hook did not fire as ready; return those with no gradient at all.

        A parameter may lack a hook call yet hold a gradient (accumulated under no_sync, or never zeroed):
        that gradient is reduced as it is. One with ``.grad`` None contributes zeros.
        """
        missing = []
        for position, ready in enumerate(self._ready):
            if ready:
                continue
            param = self._params[position]
            bucket, view = self._slots[position]
            if param.grad is None:
                view.zero_()
                missing.append(position)
            else:
                self._adopt(param, view)
            bucket.pending -= 1
        return missing

    def _start_usage(self, missing: list[int]) -> Work:
        """Which parameters had a gradient on any rank (globally unused ones keep ``.grad`` None)."""
        self._usage.fill_(1)
        if missing:
            self._usage[missing] = 0
        work = self.comm.all_reduce(self._usage, ReduceOp.MAX, async_op=True)
        assert work is not None
        return work


def _hook(reducer: weakref.ref[GradReducer], position: int):
    def hook(_param: torch.Tensor) -> None:
        target = reducer()
        if target is not None:
            target.on_gradient(position)

    return hook
