"""A ZeRO-sharded model's and optimizer's state under the plain model's names, for DCP.

``torch.distributed.checkpoint`` reshards by name and shape: a checkpoint written by one layout (ZeRO on
2 ranks, plain data parallelism, tensor-parallel slices) loads into another when every layout describes
the same logical tensors. :func:`zero_state_dict` therefore gives the layout of a data-parallel
checkpoint — ``model[name]`` and ``optim.state[name][key]`` shaped like the plain parameter, the
optimizer's ``param_groups`` naming parameters — but each tensor is a ``DTensor`` whose local pieces
are views of this rank's flat master shard (or AdamW moment). A flat shard cuts parameters at
arbitrary element offsets, so a rank's piece of a parameter is described as the few rectangular boxes
covering it (:func:`~.rectangles.boxes`), computed from the layout every rank knows: no metadata is
exchanged, padding is never written, and no rank ever holds a whole tensor. Model-agnostic: the callers
are ``train mlp|cnn|deep-mlp --zero N`` and ``train gpt --zero N`` (which adds tensor-parallel
:class:`Slices`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from meshwise.parallel.optimizer_state import init_optimizer_state
from meshwise.parallel.zero.flat import FlatGroup
from meshwise.parallel.zero.rectangles import boxes
from meshwise.parallel.zero.sharded import ShardedModel


def zero_state_dict(
    zero: ShardedModel,
    optimizer: torch.optim.Optimizer,
    slices_of: Callable[[str, torch.Tensor], Slices] | None = None,
    group_names: list[list[str]] | None = None,
    optimizer_key: Callable[[str], str] = lambda name: name,
) -> dict[str, Any]:
    """The data-parallel checkpoint layout — ``model[name]`` and ``optim.state[name][key]`` shaped like
    the plain parameter — where each tensor is a ``DTensor`` (:func:`sharded_tensor`) whose local pieces
    are views of this rank's master shard (or AdamW moment), placed in the plain parameter by
    ``slices_of`` (default: the parameter itself; ``train gpt``'s ``zero_slices`` adds tensor
    parallelism): DCP
    writes only this rank's elements, and loading into this dict reads only the ranges this rank's layout
    needs, in place. No rank ever holds a whole tensor, which is the point of ZeRO when a model does not
    fit. The scalar ``step`` is replicated. ``group_names``: the plain model's names of each optimizer
    group (as a data-parallel run records them; default: the names of the flat groups each optimizer
    group holds, in order); ``optimizer_key``: a parameter's key in the optimizer
    state (a pipeline's head copy keeps AdamW's state under the tied embedding's name).
    :func:`load_zero_state_dict` expects this dict back, filled by ``dcp.load``."""
    init_optimizer_state(optimizer)
    # that step's refresh started all-gathers (stages 1/2) whose input is this rank's slot of the full
    # buffer — the master shard dcp.load writes into: they must land first, or one landing after the load
    # puts the pre-load values back into the slot
    zero.wait_gathered()
    state: dict[str, dict[str, Any]] = {}
    params: dict[int, Any] = {}
    for group, names in zip(zero.groups, zero.param_names, strict=True):
        for index, (name, param) in enumerate(zip(names, group.params, strict=True)):
            slices = slices_of(name, param) if slices_of is not None else None
            shape = tuple(param.shape)
            params[id(param)] = sharded_tensor(group, index, group.master.detach(), shape, slices=slices)
            for key, value in optimizer.state[group.master].items():
                if _per_element(value, group.master):
                    piece = sharded_tensor(group, index, value.detach(), shape, slices=slices)
                else:  # scalar state shared by the whole shard (AdamW's step)
                    piece = value.clone() if isinstance(value, torch.Tensor) else value
                state.setdefault(optimizer_key(name), {})[key] = piece
    model = {
        key: params[id(value)] if id(value) in params else value.detach().clone()
        for key, value in zero.module.state_dict(keep_vars=True).items()
    }
    if group_names is None:
        held = {id(g.master): n for g, n in zip(zero.groups, zero.param_names, strict=True)}
        group_names = [[n for m in group["params"] for n in held[id(m)]] for group in optimizer.param_groups]
    param_groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": names}
        for group, names in zip(optimizer.param_groups, group_names, strict=True)
    ]
    return {"model": model, "optim": {"state": state, "param_groups": param_groups}}


@torch.no_grad()
def load_zero_state_dict(
    zero: ShardedModel,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    optimizer_key: Callable[[str], str] = lambda name: name,
) -> None:
    """Finish a load into :func:`zero_state_dict`'s dict: DCP already wrote this rank's ranges (of a
    checkpoint from any layout: dp, tp, pp, any stage or N) into the master shards and moments through the
    local shards' views; what is left is pushing masters to the compute copies, the replicated scalars and
    buffers (the hyper-parameters stay this run's: they come from its flags, the rate from the schedule)."""
    buffers = dict(zero.module.named_buffers())
    for key, value in state["model"].items():
        if key in buffers:
            buffers[key].copy_(value)
    saved = state["optim"]["state"]
    for group, names in zip(zero.groups, zero.param_names, strict=True):
        group.refresh()
        entry = optimizer.state[group.master]
        for key, value in saved[optimizer_key(names[0])].items():
            if not _per_element(entry.get(key), group.master):
                entry[key] = value.clone() if isinstance(value, torch.Tensor) else value


def _per_element(value: Any, master: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == master.numel()


def sharded_tensor(
    group: FlatGroup,
    index: int,
    flat: torch.Tensor,
    shape: tuple[int, ...] | None = None,
    *,
    slices: Slices | None = None,
) -> DTensor:
    """Parameter ``index`` of ``group`` as a DTensor of ``shape`` (default: 1-D, its ``numel``
    elements) whose local pieces are views of ``flat`` (this rank's flat shard of a parameter-shaped
    quantity: the master, a moment, a staging buffer). Each rank's piece of the parameter becomes the
    :func:`~.rectangles.boxes` covering it, computed from the layout every rank knows, so no metadata
    is exchanged and padding is never part of a shard.

    ``slices`` places it on a larger mesh (see :class:`Slices`): a tensor-parallel slice's boxes move to
    where it lies in the plain parameter — the DTensor then has the plain parameter's shape and every
    (dp, tp) rank's pieces together cover it.

    Why this form: a flat shard cuts a parameter at an arbitrary element, so a rank holds up to three
    rectangles of it (a partial row, whole rows, a partial row), which no DTensor placement
    (``Shard``, uneven ``torch.chunk`` splits, ``_StridedShard``) describes — they all give a rank one
    rectangle. DTensor's checkpoint protocol defers to its local tensor, and torch's
    ``LocalShardsWrapper`` (what torchrec checkpoints its row/column-wise tables with) holds several
    rectangles with their offsets; DCP then writes exactly these chunks, as plain tensor chunks that
    ``dcp_to_torch_save`` reads with torch alone. The DTensor lives on a 1-D ``DeviceMesh`` over the
    job (``Shard(0)``: each rank holds its own part); the chunks, not the placement, say which part."""
    layout = group.layout
    shape = (layout.numels[index],) if shape is None else tuple(shape)
    slices = slices if slices is not None else Slices()
    whole = slices.whole or shape
    local, offsets = [], []
    for piece in (p for p in layout.pieces(group.comm.rank) if p.param == index):
        for box in boxes(shape, piece.param_start, piece.param_start + piece.numel):
            start, sizes = list(box.offsets), list(box.sizes)
            start[slices.dim] += slices.mine * shape[slices.dim]
            sizes[slices.dim] = min(sizes[slices.dim], whole[slices.dim] - start[slices.dim])
            if sizes[slices.dim] <= 0:
                continue  # vocabulary padding only
            begin = piece.shard_start + box.flat_start - piece.param_start
            view = flat[begin : begin + box.numel].view(box.sizes)
            local.append(view.narrow(slices.dim, 0, sizes[slices.dim]))
            offsets.append(tuple(start))
    if not local:  # an empty chunk: DCP mishandles a key some rank holds nothing of (it then reads
        # nested keys the pre-2.4 way and misses them), and an empty parameter still needs one chunk.
        # It sits at the far corner: DCP tells chunks apart by offset, and no real chunk starts there
        local.append(flat[:0].view([0] * len(whole)))
        offsets.append(tuple(whole))
    return _dtensor(LocalShardsWrapper(local, offsets), torch.Size(whole), flat.dtype)


def _dtensor(pieces: LocalShardsWrapper, whole: torch.Size, dtype: torch.dtype) -> DTensor:
    """A DTensor of global shape ``whole`` holding ``pieces`` on a 1-D mesh over the job. The mesh only
    describes (DCP asks the pieces, never the mesh's process groups), so it is built without any:
    creating them is collective and, for gloo on a CUDA machine, a new process group per tensor. Built
    from its spec rather than ``DTensor.from_local``, which views the local tensor as a whole and so would
    refuse pieces of a tensor with more than two dimensions (a convolution's weight)."""
    world = torch.arange(dist.get_world_size())
    mesh = DeviceMesh(pieces.device.type, world, _init_backend=False, _rank=dist.get_rank())
    meta = TensorMeta(whole, torch.empty(whole, device="meta").stride(), dtype)
    spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=meta)
    return DTensor(pieces, spec, requires_grad=False)


@dataclass(frozen=True)
class Slices:
    """How a ZeRO-sharded parameter lies in the plain one. Without tensor parallelism it is the plain
    parameter itself. With it, a tp-sharded parameter is slice ``mine`` (this tp rank's shard) of
    ``whole`` along ``dim``; a tp-replicated one is the whole parameter on every tp rank, whose copies
    describe the same chunks, which DCP writes once."""

    mine: int = 0
    whole: tuple[int, ...] | None = None
    dim: int = 0
