"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP) that reshard N → M ranks.

Each rank writes only what it holds. A flat shard cuts parameters at arbitrary element offsets, so a
parameter is stored as the 1-D vector of its elements, and each rank contributes the pieces of that
vector inside its shard (a ``ShardedTensor`` whose chunks are the :class:`~.layout.Piece` ranges, built
from the layout every rank can compute, so no metadata is exchanged). DCP records which file holds
which element range; loading asks for the ranges the *new* layout needs, so any world size and any stage
(or one process, unsharded) reads the same checkpoint.

Keys: ``model.<parameter>`` (1-D, ``numel`` elements), ``buffer.<name>`` (replicated),
``optim.<parameter>.<state>`` for per-element optimizer state (Adam's moments, SGD's momentum, laid out
like the parameter) and ``optim.<state>`` for scalar state shared by every shard (Adam's step).

A checkpoint is checked against the model before anything is read into it: a missing, extra or
differently sized parameter is one error naming it, and the model and optimizer stay untouched. Saving
refuses to overwrite an existing checkpoint unless asked to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from meshwise.parallel.zero.flat import FlatGroup
from meshwise.parallel.zero.rectangles import boxes
from meshwise.parallel.zero.sharded import ShardedModel

_MARKER = ".metadata"  # the file DCP writes last: its presence means a complete checkpoint


def save_sharded(
    model: ShardedModel,
    optimizer: torch.optim.Optimizer | None,
    directory: str | Path,
    *,
    overwrite: bool = False,
) -> Path:
    """Collective: every rank writes its shards of the model (and of ``optimizer``'s state)."""
    directory = Path(directory)
    _check_process_group(model)
    if (directory / _MARKER).exists() and not overwrite:
        raise FileExistsError(
            f"{directory} already holds a checkpoint; choose another directory or pass overwrite=True"
        )
    state: dict[str, Any] = {}
    scalars: dict[str, torch.Tensor] = {}
    for group, names in zip(model.groups, model.param_names, strict=True):
        for index, name in enumerate(names):
            state[f"model.{name}"] = sharded_tensor(group, index, group.master.detach())
        for key, value in (optimizer.state.get(group.master, {}) if optimizer else {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.numel() == group.master.numel():
                for index, name in enumerate(names):
                    state[f"optim.{name}.{key}"] = sharded_tensor(group, index, value.reshape(-1))
            else:
                scalars.setdefault(f"optim.{key}", value.detach().clone())
    state.update(scalars)
    for name, buffer in model.module.named_buffers():
        state[f"buffer.{name}"] = buffer.detach()
    dcp.save(state, checkpoint_id=str(directory))
    return directory


def load_sharded(model: ShardedModel, optimizer: torch.optim.Optimizer | None, directory: str | Path) -> None:
    """Collective: read a checkpoint of any world size and stage into ``model`` (and ``optimizer``)."""
    _check_process_group(model)
    stored = _stored(directory)
    expected = {f"model.{name}": numel for group, names in zip(model.groups, model.param_names, strict=True)
                for name, numel in zip(names, group.layout.numels, strict=True)}  # fmt: skip
    expected |= {f"buffer.{n}": b.numel() for n, b in model.module.named_buffers()}
    _check_matches(stored, expected, directory)
    staging = [torch.zeros_like(group.master.detach()) for group in model.groups]
    state: dict[str, Any] = {}
    for group, names, flat in zip(model.groups, model.param_names, staging, strict=True):
        for index, name in enumerate(names):
            state[f"model.{name}"] = sharded_tensor(group, index, flat)
    per_element: dict[tuple[int, str], torch.Tensor] = {}
    if optimizer is not None:
        held = {id(p) for p in _params_of(optimizer)}
        for gi, (group, names) in enumerate(zip(model.groups, model.param_names, strict=True)):
            keys = {k[len(f"optim.{names[0]}.") :] for k in stored if k.startswith(f"optim.{names[0]}.")}
            for key in sorted(keys) if id(group.master) in held else ():
                flat = per_element[(gi, key)] = torch.zeros_like(group.master.detach())
                for index, name in enumerate(names):
                    state[f"optim.{name}.{key}"] = sharded_tensor(group, index, flat)
        for key in stored:
            if key.startswith("optim.") and key.count(".") == 1:
                state[key] = torch.zeros(stored[key].size, dtype=stored[key].properties.dtype)
    buffers = {f"buffer.{n}": torch.empty_like(b) for n, b in model.module.named_buffers()}
    state.update(buffers)
    dcp.load(state, checkpoint_id=str(directory))
    with torch.no_grad():
        for group, flat in zip(model.groups, staging, strict=True):
            group.wait_gathered()
            group.master.copy_(flat)
            group.refresh()
        for name, buffer in model.module.named_buffers():
            buffer.copy_(buffers[f"buffer.{name}"])
    if optimizer is not None:
        scalars = {
            k[len("optim.") :]: v for k, v in state.items() if k.startswith("optim.") and k.count(".") == 1
        }
        for (gi, key), flat in per_element.items():
            optimizer.state[model.groups[gi].master][key] = flat
        for gi, group in enumerate(model.groups):
            if any(g == gi for g, _ in per_element):
                for key, value in scalars.items():
                    optimizer.state[group.master][key] = value.clone()


def load_unsharded(model: nn.Module, directory: str | Path) -> None:
    """Read a sharded checkpoint's parameters and buffers into a plain model, in one process or many."""
    stored = _stored(directory)
    params = dict(model.named_parameters())
    expected = {f"model.{n}": p.numel() for n, p in params.items()}
    expected |= {f"buffer.{n}": b.numel() for n, b in model.named_buffers()}
    _check_matches(stored, expected, directory)
    state = {f"model.{n}": torch.empty(p.numel(), dtype=p.dtype) for n, p in params.items()}
    state |= {f"buffer.{n}": torch.empty_like(b) for n, b in model.named_buffers()}
    dcp.load(state, checkpoint_id=str(directory), no_dist=not dist.is_initialized())
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[f"model.{name}"].view(param.shape))
        for name, buffer in model.named_buffers():
            buffer.copy_(state[f"buffer.{name}"])


def export_full(model: ShardedModel, path: str | Path) -> Path | None:
    """Collective: the plain model's full state dict in one ``torch.save`` file, written by rank 0
    (atomically: a temporary file renamed into place). Returns the path on rank 0, None elsewhere."""
    state = model.state_dict()
    if model.comm.rank != 0:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save(state, temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


# ---------------------------------------------------------------------- helpers
def sharded_tensor(
    group: FlatGroup,
    index: int,
    flat: torch.Tensor,
    shape: tuple[int, ...] | None = None,
    *,
    slices: Slices | None = None,
) -> ShardedTensor:
    """Parameter ``index`` of ``group`` as a ShardedTensor of ``shape`` (default: 1-D, its ``numel``
    elements) whose local shards are views of ``flat`` (this rank's flat shard of a parameter-shaped
    quantity: the master, a moment, a staging buffer). Each rank's piece of the parameter becomes the
    :func:`~.rectangles.boxes` covering it, computed from the layout every rank knows, so no metadata
    is exchanged and padding is never part of a shard.

    ``slices`` places it on a larger mesh (see :class:`Slices`): shards are named by job rank, and a
    tensor-parallel slice's boxes move to where it lies in the plain parameter — the ShardedTensor then
    has the plain parameter's shape and every (dp, tp) rank's shards together cover it."""
    layout = group.layout
    shape = (layout.numels[index],) if shape is None else tuple(shape)
    slices = slices if slices is not None else Slices.flat(group.comm.world_size)
    whole = slices.whole or shape
    device = flat.device.type
    metadata, local = [], []
    for slice_index, owners in enumerate(slices.owners):
        offset = slice_index * shape[slices.dim]
        for rank in range(layout.world_size):
            mine = slice_index == slices.mine and rank == group.comm.rank
            placement = f"rank:{owners[rank]}/{device}"
            placed = 0
            for piece in (p for p in layout.pieces(rank) if p.param == index):
                for box in boxes(shape, piece.param_start, piece.param_start + piece.numel):
                    offsets, sizes = list(box.offsets), list(box.sizes)
                    offsets[slices.dim] += offset
                    sizes[slices.dim] = min(sizes[slices.dim], whole[slices.dim] - offsets[slices.dim])
                    if sizes[slices.dim] <= 0:
                        continue  # vocabulary padding only
                    metadata.append(ShardMetadata(offsets, sizes, placement))
                    placed += 1
                    if mine:
                        begin = piece.shard_start + box.flat_start - piece.param_start
                        view = flat[begin : begin + box.numel].view(box.sizes)
                        local.append(Shard(view.narrow(slices.dim, 0, sizes[slices.dim]), metadata[-1]))
            if not placed:  # an empty chunk: DCP mishandles a key some rank holds nothing of (it then
                # reads nested keys the pre-2.4 way and misses them), and an empty parameter still needs
                # one chunk. It sits at the far corner: DCP tells chunks apart by offset, and no real
                # chunk starts there
                empty = [0] * len(whole)
                metadata.append(ShardMetadata(list(whole), empty, placement))
                if mine:
                    local.append(Shard(flat[:0].view(empty), metadata[-1]))
    properties = TensorProperties(dtype=flat.dtype)
    global_metadata = ShardedTensorMetadata(metadata, torch.Size(whole), properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, global_metadata)


@dataclass(frozen=True)
class Slices:
    """How a ZeRO-sharded parameter lies on the job: ``owners[t][d]`` is the job rank holding flat-layout
    rank ``d``'s piece of slice ``t``; this rank holds slice ``mine``. Without tensor parallelism there
    is one slice, the parameter itself. With it, a tp-sharded parameter is slice ``t`` (tp rank t's
    shard) of ``whole`` along ``dim``; a tp-replicated one is one slice, and its copies on the other tp
    ranks describe the same chunks, which DCP writes once."""

    owners: tuple[tuple[int, ...], ...]
    mine: int = 0
    whole: tuple[int, ...] | None = None
    dim: int = 0

    @classmethod
    def flat(cls, ranks: int) -> Slices:
        """One slice whose flat-layout ranks are job ranks 0..ranks-1 (ZeRO over the whole job)."""
        return cls(owners=(tuple(range(ranks)),))


def _params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _stored(directory: str | Path) -> dict[str, TensorStorageMetadata]:
    directory = Path(directory)
    if not (directory / _MARKER).is_file():
        raise FileNotFoundError(f"{directory} holds no complete sharded checkpoint (no {_MARKER} file)")
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def _check_matches(
    stored: dict[str, TensorStorageMetadata], expected: dict[str, int], directory: Any
) -> None:
    """The checkpoint holds exactly the model's parameters and buffers, with the same sizes."""
    held = {k: v for k, v in stored.items() if k.startswith(("model.", "buffer."))}
    missing = sorted(set(expected) - set(held))
    extra = sorted(set(held) - set(expected))
    resized = sorted(k for k in set(expected) & set(held) if held[k].size.numel() != expected[k])
    if missing or extra or resized:
        details = [f"{label}: {', '.join(keys[:5])}{' …' if len(keys) > 5 else ''}"
                   for label, keys in (("missing", missing), ("not in the model", extra),
                                       ("different size", resized)) if keys]  # fmt: skip
        raise ValueError(
            f"the checkpoint in {directory} was written for a different model ({'; '.join(details)}); "
            "nothing was loaded: build the model with the configuration the checkpoint was saved from"
        )


def _check_process_group(model: ShardedModel) -> None:
    if (
        not dist.is_initialized()
        or dist.get_world_size() != model.comm.world_size
        or (dist.get_rank() != model.comm.rank)
    ):
        raise ValueError(
            "sharded checkpoints go through torch.distributed.checkpoint and need the model sharded over the "
            "whole job (meshwise.init()'s world); for a sub-group, export_full() writes one plain file"
        )
