"""``DataParallel``: replicate a model on every rank and average its gradients, as torch's DDP does.

Wrapping is the only change a single-process training loop needs::

    model = DataParallel(model)          # every rank now holds rank 0's weights
    loss_fn(model(x_shard), y_shard).backward()   # returns with gradients averaged over the ranks
    optimizer.step()

Rank 0's parameters and buffers are broadcast at wrap time, so replicas seeded differently start equal and
stay equal. Gradients average in buckets from autograd hooks (:mod:`.buckets`, :mod:`.reducer`), so
communication overlaps the rest of backward; ``no_sync()`` skips it for gradient accumulation. The state
dict has no ``module.`` prefix, so a checkpoint loads into the plain model and back.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from meshwise.comm.api import SUPPORTED_DTYPES, Communicator
from meshwise.parallel.data_parallel.buckets import MIB, plan_buckets
from meshwise.parallel.data_parallel.reducer import GradReducer
from meshwise.parallel.expert_parallel.placement import ExpertReplicas, replica_groups
from meshwise.world import current_world

#: ``compress=`` names → the dtype gradients travel in (reduced in float32 by every backend, rounded once).
WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

_PREFIX = "module."


class DataParallel(nn.Module):
    """Data-parallel wrapper over any :class:`~meshwise.comm.api.Communicator` (gloo, nccl, shm, mpi).

    ``comm`` defaults to ``meshwise.current_world().comm``. ``bucket_mb`` and ``first_bucket_mb`` cap the
    buckets in MiB. ``find_unused_parameters=True`` accepts parameters that get no gradient in a step
    (they count as zeros; those unused on every rank keep ``.grad`` None, as without the wrapper);
    otherwise such a parameter raises :class:`~meshwise.parallel.UnusedParametersError` naming it, after
    the step's collectives completed on this rank so that no peer is left waiting. ``compress`` (``"bf16"``
    or ``"fp16"``) rounds float32 gradients to half precision for the all-reduce: half the bytes on shm,
    while gloo, nccl and mpi widen halves back to float32 to reduce them (docs/training.md). ``experts``
    (experts cut over ``ep``): expert gradients average over their own replicas, dense ones over
    ``comm`` (:func:`~meshwise.parallel.expert_parallel.replica_groups`), each group its own reducer.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator | None = None,
        *,
        bucket_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        find_unused_parameters: bool = False,
        compress: str | None = None,
        experts: ExpertReplicas | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
        if compress is not None and compress not in WIRE_DTYPES:
            raise ValueError(f"compress={compress!r} is unknown; use None or one of {sorted(WIRE_DTYPES)}")
        caps = round(bucket_mb * MIB), round(first_bucket_mb * MIB)
        plan_buckets([], *caps)  # bad caps fail before a communicator is looked up
        self.module = module
        self.comm = comm if comm is not None else current_world().comm
        self._require_sync = True
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        groups = replica_groups(named, self.comm, experts)
        if experts is None:
            broadcast_module_state(module, self.comm)
        else:  # each group from its first rank
            for params, group in groups:
                broadcast_tensors([p for _, p in params], group)
        plans = [plan_buckets([p for _, p in params], *caps) for params, _ in groups]
        self.buckets = [bucket for plan in plans for bucket in plan]  # with ``experts``: dense, then experts'
        self._reducers = [
            GradReducer(
                params,
                group,
                plan,
                find_unused_parameters=find_unused_parameters,
                wire_dtype=WIRE_DTYPES.get(compress or ""),
            )
            for (params, group), plan in zip(groups, plans, strict=True)
            if group.world_size > 1
        ]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        for reducer in self._reducers:
            reducer.prepare(self._require_sync)  # decided here, as in torch: backward follows forward
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside accumulate locally; the next synchronised one averages
        the sum, so k micro-batches cost one all-reduce per bucket instead of k."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous


def broadcast_module_state(module: nn.Module, comm: Communicator, root: int = 0) -> None:
    """Overwrite every rank's parameters and buffers with ``root``'s: one broadcast per dtype/device."""
    broadcast_tensors([*module.parameters(), *module.buffers()], comm, root)


def broadcast_tensors(tensors: list[torch.Tensor], comm: Communicator, root: int = 0) -> None:
    """Overwrite every rank's ``tensors`` (the same list, shape for shape, on every rank) with
    ``root``'s: one flat broadcast per dtype/device."""
    if comm.world_size == 1 or not tensors:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
    for tensor in tensors:
        groups[(tensor.dtype, tensor.device)].append(tensor)
    with torch.no_grad():
        for (dtype, _), members in groups.items():
            if dtype not in SUPPORTED_DTYPES:  # e.g. bool or uint8 buffers travel widened
                dtype = torch.float64 if dtype.is_floating_point else torch.int64
            flat = torch.cat([t.detach().reshape(-1).to(dtype) for t in members])
            comm.broadcast(flat, root)
            for tensor, piece in zip(members, flat.split([t.numel() for t in members]), strict=True):
                tensor.copy_(piece.view(tensor.shape))


def _rename(state: dict[str, Any], old: str, new: str) -> None:
    """Move every key starting with ``old`` to start with ``new`` instead, keeping their order."""
    for key in [k for k in state if k.startswith(old)]:
        state[new + key[len(old) :]] = state.pop(key)


def _strip_prefix(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
    """state_dict post-hook: the wrapped model's keys, and its modules' version metadata (this fresh
    state dict's own, renamed in place), lose ``module.``; its root entry replaces the wrapper's."""
    _rename(state, prefix + _PREFIX, prefix)
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        old = prefix + _PREFIX
        for key in [k for k in metadata if k == old[:-1] or k.startswith(old)]:
            value = metadata.pop(key)
            metadata[prefix[:-1] if key == old[:-1] else prefix + key[len(old) :]] = value


def _add_prefix(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
    """load_state_dict pre-hook: plain keys are routed to the wrapped model (only the keys: the metadata
    is the caller's, and without its version entries a module loads as its current version)."""
    _rename(state, prefix, prefix + _PREFIX)
