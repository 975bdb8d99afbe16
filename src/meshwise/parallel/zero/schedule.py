"""Stage 3's gather/free schedule: a unit's parameters exist only around its forward and its backward.

Hooks on each unit module:

- before forward: wait for the unit's gather (usually prefetched already), then start the gathers of
  the next ``prefetch`` units, so their communication overlaps this unit's compute;
- after forward: free the unit (with ``reshard_after_forward``; otherwise it stays until its backward);
- before backward (a hook on its outputs fires when their gradient is ready): gather it again and prefetch the
  ``prefetch`` units whose backward comes next (the previous ones in forward order);
- after backward (all its gradients arrived, reported by :class:`GradientSync`): free it.

The root (parameters no unit owns) is gathered when the model's forward starts and freed when backward
ends, or at the end of a forward without autograd (evaluation).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from meshwise.parallel.zero.flat import FlatGroup


class UnitSchedule:
    """Gathers and frees the groups of ``units`` (index 1..U in forward order; 0 is the root)."""

    def __init__(
        self,
        units: Sequence[nn.Module],
        groups: Sequence[FlatGroup],
        unit_of: Sequence[int],
        *,
        prefetch: int,
        reshard_after_forward: bool,
        on_backward_start: Callable[[], None],
    ) -> None:
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self._groups: dict[int, list[FlatGroup]] = {unit: [] for unit in range(len(units) + 1)}
        for group, unit in zip(groups, unit_of, strict=True):
            self._groups[unit].append(group)
        self._on_backward_start = on_backward_start
        #: set by :meth:`ShardedModel.gathered`: every unit stays gathered, the hooks free nothing
        self.holding = False
        for index, module in enumerate(units, start=1):
            module.register_forward_pre_hook(partial(self._before_forward, index))
            module.register_forward_hook(partial(self._after_forward, index))

    def gather(self, unit: int, wait: bool = True) -> None:
        """Start ``unit``'s gather (if no prefetch did) and, with ``wait``, make its parameters usable now."""
        for group in self._groups[unit]:
            group.gather()
        for group in self._groups[unit] if wait else ():
            group.wait_gathered()

    def free(self, unit: int) -> None:
        if self.holding:
            return
        for group in self._groups[unit]:
            group.free()

    def free_all(self) -> None:
        for unit in self._groups:
            self.free(unit)

    def _before_forward(self, index: int, _module: nn.Module, _args: Any) -> None:
        self.gather(index)
        for ahead in range(index + 1, min(index + self.prefetch, len(self._groups) - 1) + 1):
            self.gather(ahead, wait=False)

    def _after_forward(self, index: int, _module: nn.Module, _args: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for tensor in tree_leaves(output):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(partial(self._before_backward, index))
        if self.reshard_after_forward or not torch.is_grad_enabled():
            self.free(index)

    def _before_backward(self, index: int, _grad: torch.Tensor) -> None:
        self._on_backward_start()
        self.gather(index)
        for behind in range(index - 1, max(index - self.prefetch, 1) - 1, -1):
            self.gather(behind, wait=False)
