"""Gradients of a sharded model: from autograd's hooks into flat buffers, then reduce-scattered.

Every trainable parameter has a post-accumulate-grad hook that adds its gradient into its group's
unsharded buffer and drops ``param.grad`` (the optimizer never sees full gradients). A group is
reduce-scattered as soon as its last gradient arrived, strictly in plan order, so all ranks issue the
same collectives in the same order and communication overlaps the rest of backward; a callback at the end
of backward launches what is left and waits for all. Under ``no_sync`` the unsharded buffers only
accumulate: k micro-batches cost one reduce-scatter. Stage 1 keeps its unsharded buffers for the whole
run (the ZeRO-1 memory model) and reduce-scatters what only accumulated under ``no_sync`` when the
optimizer steps or clips; stages 2 and 3 drop each as soon as its reduce-scatter landed. Stage 3's
schedule also learns here when a unit's backward is over, to free its parameters at once.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Sequence
from functools import partial

import torch

from meshwise.parallel.zero.flat import FlatGroup
from meshwise.parallel.zero.schedule import UnitSchedule
from meshwise.parallel.zero.units import ROOT

#: Reduce-scatters allowed in flight at once (FSDP2 keeps one): each holds a unit's unsharded gradient.
MAX_IN_FLIGHT = 2


class GradientSync:
    """Hooks on every trainable parameter of ``groups`` (given in gradient-ready order)."""

    def __init__(
        self,
        groups: Sequence[FlatGroup],
        *,
        unit_of: Sequence[int],
        schedule: UnitSchedule | None,
    ) -> None:
        self.sync = True
        self.schedule = schedule  # stage 3's: told when a unit's backward is over, and backward's end
        trainable = [(group, unit) for group, unit in zip(groups, unit_of, strict=True) if group.trainable]
        self.groups = [group for group, _ in trainable]
        self._unit_of = [unit for _, unit in trainable]
        self._unit_size: Counter[int] = Counter()
        for group, unit in trainable:
            self._unit_size[unit] += len(group.params)
        self._reset()
        self._unreduced: set[FlatGroup] = set()  # groups that accumulated since their last reduction
        this = weakref.ref(self)  # a hook outliving its model does nothing
        for gi, group in enumerate(self.groups):
            for pi, param in enumerate(group.params):
                param.register_post_accumulate_grad_hook(partial(_hook, this, gi, pi))

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
        if self._unit_pending[unit] == 0 and unit != ROOT and self.schedule is not None:
            self.schedule.free(unit)
        self._unreduced.add(group)
        if not self.sync:
            return
        self._pending[gi] -= 1
        self._launch_in_order()

    def _launch_in_order(self) -> None:
        while self._next < len(self.groups) and self._pending[self._next] == 0:
            self.groups[self._next].launch_reduce()
            self._next += 1
        in_flight = [group for group in self.groups[: self._next] if group.reducing]
        for index, group in enumerate(in_flight):
            # landed ones drop their unsharded buffer now; past the cap the oldest is waited for, so
            # unsharded gradients cannot pile up while a slow transport falls behind backward (stage 1
            # keeps its buffers anyway, so nothing piles up there)
            if group.reduce_landed() or (
                not group.keeps_full_grad and len(in_flight) - index > MAX_IN_FLIGHT
            ):
                self._finish_reduce(group)

    def _finish_reduce(self, group: FlatGroup) -> None:
        group.finish_reduce()
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
            if self.schedule is not None:
                self.schedule.free_all()

    def reduce_for_step(self, groups: Sequence[FlatGroup]) -> None:
        """Stage 1: reduce-scatter what backward accumulated under ``no_sync`` only, before the step or
        a clip (stages 2/3 leave such gradients unreduced, as DataParallel does)."""
        self.reduce_accumulated([group for group in groups if group.keeps_full_grad])

    def reduce_accumulated(self, groups: Sequence[FlatGroup]) -> None:
        """Reduce-scatter now what backward accumulated under ``no_sync`` in ``groups`` (any stage: for a
        caller whose backward passes all ran under ``no_sync``, e.g. a pipeline's micro-batches)."""
        chosen = [group for group in groups if group in self._unreduced]
        for group in chosen:
            group.launch_reduce()
        for group in chosen:
            self._finish_reduce(group)


def _hook(sync: weakref.ref[GradientSync], gi: int, pi: int, _param: torch.Tensor) -> None:
    target = sync()
    if target is not None:
        target.on_gradient(gi, pi)
