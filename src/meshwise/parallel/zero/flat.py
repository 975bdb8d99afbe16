"""One flat group at run time: its master shard, its gathered compute buffer and its gradient buffers.

The module keeps its own ``nn.Parameter`` objects, but their ``.data`` become views into the group's
*full* buffer (the flat vector, padded, in the compute dtype). Freeing a gathered group shrinks that
buffer's storage to zero bytes and gathering grows it back and all-gathers into it: the parameters,
and any view autograd saved of them during forward, see the refreshed storage, so backward reads the
re-gathered weights without the model knowing it was ever sharded (FSDP's storage-resize trick).

What each rank holds between steps:

- ``master``: this rank's slice of the flat vector in the parameters' own dtype (float32): the tensor the
  optimizer updates. In full precision with the full buffer kept (stages 1/2) it is a view of this rank's
  slot of the full buffer, so nothing is stored twice.
- ``compute_shard`` (stage 3 only): the slice in the compute dtype, the all-gather's input.
- ``full``: the gathered flat vector; kept by stages 1/2, transient in stage 3.
- ``flat_grad``: the unsharded gradient in the reduction dtype (kept by stage 1; transient in stages
  2/3, alive from a unit's first gradient to its reduce-scatter).
- ``grad_shard``: this rank's reduced gradient (stages 2/3 keep it; stage 1 only between its
  reduce-scatter at step time and the step).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from meshwise.comm.api import Communicator, ReduceOp, Work
from meshwise.parallel.zero.layout import FlatLayout


class Tracker:
    """Bytes of transient full-size buffers (gathered parameters, unsharded gradients) and their peak."""

    def __init__(self) -> None:
        self.current = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` more (fewer, when negative) alive now."""
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def reset_peak(self) -> None:
        self.peak = self.current


class FlatGroup:
    """A group of parameters flattened, padded and sharded over ``comm`` (the ranks that replicate them:
    an expert's over its own, :mod:`~meshwise.parallel.zero.sharded`)."""

    def __init__(
        self,
        name: str,
        params: Sequence[nn.Parameter],
        comm: Communicator,
        *,
        compute_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        stage: int,
        tracker: Tracker,
        grad_scale: float = 1.0,
    ) -> None:
        self.name = name
        self.params = list(params)
        self.comm = comm
        self.layout = FlatLayout(tuple(p.numel() for p in self.params), comm.world_size)
        self.trainable = self.params[0].requires_grad
        self.persistent = stage < 3  # the full parameters stay gathered between steps
        self.keeps_full_grad = stage == 1  # the ZeRO-1 memory model: unsharded gradients stay
        self.grad_dtype = grad_dtype
        self.grad_scale = grad_scale  # the factor on every local gradient (1/ep: experts)
        self.tracker = tracker
        master_dtype, device = self.params[0].dtype, self.params[0].device
        flat = torch.zeros(self.layout.padded_numel, dtype=master_dtype, device=device)
        with torch.no_grad():
            for param, offset in zip(self.params, self.layout.offsets, strict=True):
                flat[offset : offset + param.numel()].copy_(param.detach().reshape(-1))
        start, end = self.layout.shard_range(comm.rank)
        self.master_is_separate = compute_dtype != master_dtype or not self.persistent
        master = flat[start:end].clone() if self.master_is_separate else flat[start:end]
        self.master = nn.Parameter(master, requires_grad=self.trainable)
        self.full = flat.to(compute_dtype)  # flat itself in the master's dtype
        # stage 3's all-gather input (the master's own storage in the master's dtype)
        self.compute_shard = None if self.persistent else self.master.detach().to(compute_dtype)
        for param, offset in zip(self.params, self.layout.offsets, strict=True):
            param.data = self.full[offset : offset + param.numel()].view(param.shape)
        self._full_bytes = self.full.untyped_storage().nbytes()
        self.gathered = True
        self._gather_work: Work | None = None
        self.flat_grad: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.has_grad = False  # a reduced gradient is waiting for the optimizer
        self.exposed = False  # ... and is already master.grad (possibly unscaled: not to be exposed again)
        self._reduce_work: Work | None = None
        self._reduce_out: torch.Tensor | None = None
        if not self.persistent:
            self.tracker.add(self._full_bytes)  # counted while gathered, like every later gather
            self.free()
        if self.trainable:  # the gradient buffer the stage keeps, up front so the memory report is exact
            if self.keeps_full_grad:
                self.flat_grad = torch.zeros(self.layout.padded_numel, dtype=grad_dtype, device=device)
            else:
                self.grad_shard = torch.zeros(self.layout.shard_numel, dtype=grad_dtype, device=device)

    # ------------------------------------------------------------------ parameters
    def gather(self) -> None:
        """Start re-materialising the full parameters (stage 3); :meth:`wait_gathered` completes it."""
        if self.gathered:
            return
        self.full.untyped_storage().resize_(self._full_bytes)
        self.tracker.add(self._full_bytes)
        assert self.compute_shard is not None
        self._gather_work = self.comm.all_gather(self.full, self.compute_shard, async_op=True)
        self.gathered = True

    def wait_gathered(self) -> None:
        if self._gather_work is not None:
            work, self._gather_work = self._gather_work, None
            work.wait()

    def free(self) -> None:
        """Drop the full parameters' storage (stage 3); views autograd saved keep pointing at it."""
        if not self.gathered:
            return
        self.wait_gathered()
        self.full.untyped_storage().resize_(0)
        self.tracker.add(-self._full_bytes)
        self.gathered = False

    def refresh(self) -> None:
        """After the optimizer updated ``master``: push it to the compute copies. Stages 1/2 start an
        all-gather of every rank's updated slice (awaited by :meth:`wait_gathered`); stage 3 only
        updates its compute shard, gathered again when the unit next runs."""
        self.wait_gathered()  # a gather no forward waited for (an unused module) lands first
        with torch.no_grad():
            if not self.persistent:
                if self.master_is_separate and self.compute_shard is not None:
                    self.compute_shard.copy_(self.master)
                return
            start, end = self.layout.shard_range(self.comm.rank)
            if self.master_is_separate:
                self.full[start:end].copy_(self.master)
            self._gather_work = self.comm.all_gather(self.full, self.full[start:end], async_op=True)

    # ------------------------------------------------------------------ gradients
    @property
    def device(self) -> torch.device:
        return self.master.device

    def unsharded_gradient(self) -> torch.Tensor:
        """The unsharded gradient buffer, zeroed when it has to be created (stages 2/3: per step)."""
        if self.flat_grad is None:
            self.flat_grad = torch.zeros(self.layout.padded_numel, dtype=self.grad_dtype, device=self.device)
            self.tracker.add(self.flat_grad.untyped_storage().nbytes())
        return self.flat_grad

    def accumulate(self, index: int, grad: torch.Tensor) -> None:
        """Add one parameter's local gradient, times the group's scale, into the unsharded buffer."""
        offset = self.layout.offsets[index]
        self.unsharded_gradient()[offset : offset + grad.numel()].add_(
            grad.reshape(-1), alpha=self.grad_scale
        )

    def launch_reduce(self) -> None:
        """Start averaging the unsharded gradient over the ranks into this rank's slice."""
        flat = self.unsharded_gradient()  # zeros when no local gradient arrived: peers still need it
        self._reduce_out = torch.empty(self.layout.shard_numel, dtype=self.grad_dtype, device=self.device)
        self._reduce_work = self.comm.reduce_scatter(self._reduce_out, flat, ReduceOp.AVG, async_op=True)

    @property
    def reducing(self) -> bool:
        return self._reduce_work is not None

    def reduce_landed(self) -> bool:
        return self._reduce_work is not None and self._reduce_work.is_completed()

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter; add the result to the gradient shard; drop or zero the full one."""
        assert self._reduce_work is not None and self._reduce_out is not None
        self._reduce_work.wait()
        out, self._reduce_work, self._reduce_out = self._reduce_out, None, None
        if self.grad_shard is None:
            self.grad_shard = out
        else:
            self.grad_shard.add_(out)
        self.has_grad = True
        assert self.flat_grad is not None
        if self.keeps_full_grad:
            self.flat_grad.zero_()
        else:
            self.tracker.add(-self.flat_grad.untyped_storage().nbytes())
            self.flat_grad = None

    def expose_gradient(self, float32: bool = False) -> torch.Tensor | None:
        """Give the optimizer this rank's reduced gradient as ``master.grad`` (in the master's dtype; a
        separate float32 tensor when asked, so unscaling cannot touch the kept shard) and return it.
        Once exposed, later calls return the same tensor: an unscaled gradient is not exposed again."""
        if self.exposed or not self.has_grad or self.grad_shard is None:
            return self.master.grad if self.exposed else None
        grad = self.grad_shard
        if grad.dtype != self.master.dtype:
            grad = grad.to(self.master.dtype)
        elif float32:
            grad = grad.clone()
        self.master.grad = grad
        self.exposed = True
        return grad

    def pending_gradient(self) -> torch.Tensor | None:
        """The reduced gradient the next step will use: the exposed one, else the shard; None if none."""
        if self.exposed:
            return self.master.grad
        return self.grad_shard if self.has_grad else None

    def release_gradient(self) -> None:
        """After the step (or instead of a skipped one): the gradient was consumed."""
        self.master.grad = None
        self.has_grad = False
        self.exposed = False
        if self.grad_shard is not None:
            if not self.keeps_full_grad:  # stages 2/3 keep their gradient shard
                self.grad_shard.zero_()
            else:
                self.grad_shard = None
