"""Gradients of a sharded model: from autograd's hooks into flat buffers, then reduce-scattered.

Every trainable parameter has a post-accumulate-grad hook that adds its gradient into its group's
unsharded buffer and drops ``param.grad`` (the optimizer never sees full gradients). Every stage then
reduce-scatters a group as soon as its last gradient arrived, strictly in plan order (a complete group
waits for every earlier one), so all ranks issue the same collectives in the same order and
communication overlaps the rest of backward; a callback at the end of backward launches what is left and
waits for all. Inside :meth:`no_sync` nothing is launched and the unsharded buffers keep accumulating:
k micro-batches cost one reduce-scatter. The stages differ in what stays:

- stage 1 keeps its unsharded buffers for the whole run (zeroed once reduced: the ZeRO-1 memory model
  keeps full gradients) and its reduced shard only until the step; gradients that only ever
  accumulated under ``no_sync`` are reduce-scattered when the optimizer steps (or clips);
- stages 2 and 3 drop each unsharded buffer as soon as its reduce-scatter landed and keep the shard.

Stage 3 also learns here when a unit's backward is over (all its gradients arrived) so its gathered
parameters can be freed at once rather than at the end of backward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

from meshwise.parallel.zero.flat import FlatGroup

#: Reduce-scatters allowed in flight at once (FSDP2 keeps one): each holds a unit's unsharded gradient.
MAX_IN_FLIGHT = 2


class GradientSync:
    """Hooks on every trainable parameter of ``groups`` (given in gradient-ready order)."""

    def __init__(
        self,
        groups: Sequence[FlatGroup],
        *,
        stage: int,
        unit_of: Sequence[int],
        on_unit_done: Callable[[int], None],
        on_backward_end: Callable[[], None],
    ) -> None:
        self.stage = stage
        self.sync = True
        self.groups = [g for g in groups if g.trainable]
        self._unit_of = [unit for g, unit in zip(groups, unit_of, strict=True) if g.trainable]
        self._on_unit_done, self._on_backward_end = on_unit_done, on_backward_end
        self._unit_size: dict[int, int] = {}
        for group, unit in zip(self.groups, self._unit_of, strict=True):
            self._unit_size[unit] = self._unit_size.get(unit, 0) + len(group.params)
        self._reset()
        self._unreduced: set[FlatGroup] = set()  # groups that accumulated since their last reduction
        this = weakref.ref(self)
        self._handles = [
            param.register_post_accumulate_grad_hook(_hook(this, gi, pi))
            for gi, group in enumerate(self.groups)
            for pi, param in enumerate(group.params)
        ]

    def __del__(self) -> None:
        for handle in getattr(self, "_handles", ()):
            handle.remove()

    def _reset(self) -> None:
        self._pending = [len(g.params) for g in self.groups]
        self._unit_pending = dict(self._unit_size)
        self._next = 0
        self._queued = False

    def ensure_callback(self) -> None:
        """Queue the end-of-backward callback once per backward (call only while backward runs)."""
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True

    def on_gradient(self, gi: int, pi: int) -> None:
        group = self.groups[gi]
        param = group.params[pi]
        if param.grad is not None:
            group.accumulate(pi, param.grad)
            param.grad = None
        self.ensure_callback()
        unit = self._unit_of[gi]
        self._unit_pending[unit] -= 1
        if self._unit_pending[unit] == 0:
            self._on_unit_done(unit)
        self._unreduced.add(group)
        if not self.sync:
            return
        self._pending[gi] -= 1
        self._launch_in_order()

    def _launch_in_order(self) -> None:
        while self._next < len(self.groups) and self._pending[self._next] == 0:
            self.groups[self._next].launch_reduce()
            self._next += 1
        keep = self.stage == 1
        in_flight = [group for group in self.groups[: self._next] if group.reducing]
        for index, group in enumerate(in_flight):
            # landed ones drop their unsharded buffer now; past the cap the oldest is waited for, so
            # unsharded gradients cannot pile up while a slow transport falls behind backward (stage 1
            # keeps its buffers anyway, so nothing piles up there)
            if group.reduce_landed() or (not keep and len(in_flight) - index > MAX_IN_FLIGHT):
                self._finish_reduce(group)

    def _finish_reduce(self, group: FlatGroup) -> None:
        group.finish_reduce(keep_full=self.stage == 1)
        self._unreduced.discard(group)

    def _finish(self) -> None:
        """End of backward: every group is reduce-scattered (when synchronised) and awaited."""
        try:
            if self.sync:
                self._pending = [0] * len(self.groups)
                self._launch_in_order()
                for group in self.groups:
                    if group.reducing:
                        self._finish_reduce(group)
        finally:
            self._reset()
            self._on_backward_end()

    def reduce_for_step(self, groups: Sequence[FlatGroup]) -> None:
        """Stage 1: reduce-scatter what backward accumulated under ``no_sync`` only, before the step or
        a clip (stages 2/3 leave such gradients unreduced, as DataParallel does)."""
        if self.stage == 1:
            self.reduce_accumulated(groups)

    def reduce_accumulated(self, groups: Sequence[FlatGroup]) -> None:
        """Reduce-scatter now what backward accumulated under ``no_sync`` in ``groups`` (any stage: for a
        caller whose backward passes all ran under ``no_sync``, e.g. a pipeline's micro-batches)."""
        chosen = [group for group in groups if group in self._unreduced]
        for group in chosen:
            group.launch_reduce()
        for group in chosen:
            self._finish_reduce(group)


def _hook(sync: weakref.ref[GradientSync], gi: int, pi: int) -> Callable[[torch.Tensor], None]:
    def hook(_param: torch.Tensor) -> None:
        target = sync()
        if target is not None:
            target.on_gradient(gi, pi)

    return hook
