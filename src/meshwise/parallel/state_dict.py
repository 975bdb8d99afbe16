"""Checkpoint state written once for every layout: each rank's tensors under the plain model's names, as
the pieces of the plain tensors it holds.

``torch.distributed.checkpoint`` (DCP) reshards by name, offset and shape, so a checkpoint of one layout
loads into any other when every layout describes the *same logical tensors* — the plain model's state dict
and AdamW's state under its parameter names — and each rank says which pieces it holds: no strategy writes
its own layout. A rank's :class:`Held` records (a tensor the optimizer steps, and the :class:`Part` of a
plain tensor each range of it is) cover every case: a replicated parameter is one chunk at offset 0
(written plain: DCP writes replicas once); a tensor-parallel shard one chunk at ``tp_rank · local_size``
along its tp dimension, clipped to the plain shape (vocabulary padding is never written); a pipeline
stage holds only its names, a tied copy writes the original's chunks (DCP keeps one of identical chunks);
experts carry their global names; ZeRO's flat master shard holds the rectangles of its range of each
parameter (:func:`~meshwise.parallel.zero.state_dict.zero_held`), shifted by the same tp rule.

Weights and every per-element AdamW state are views of what the rank holds, so ``dcp.save`` writes only
this rank's elements and ``dcp.load`` writes into them in place (a Held's ``loaded`` finishes, e.g. ZeRO
refreshing its compute copies); scalar state and buffers are replicated. Every rank computes its chunks
from its placements and mesh coordinates: nothing is gathered, no metadata exchanged.

Divided tensors are DTensors of ``LocalShardsWrapper``: a rank's piece of a ZeRO-sharded parameter is up
to ``2·N − 1`` rectangles, which no DTensor placement describes, while DTensor's checkpoint protocol defers
to its local tensor and ``LocalShardsWrapper`` holds several rectangles with their offsets. DCP writes
them as plain tensor chunks, which ``dcp_to_torch_save`` reads with torch alone (no ``ShardedTensor``).

The same descriptions reassemble the plain model (:func:`gather_plain`: ``--sample``, ``--export-hf``,
parity checks): every rank writes the chunks it *counts* (``Placement.counted_at``) into zeros and one
all-reduce sums them — each element written by exactly one rank, so the sum is exact whatever the layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from meshwise.comm.api import Communicator, ReduceOp
from meshwise.parallel.optimizer_state import init_optimizer_state
from meshwise.parallel.placement import Placement

#: a view of a local tensor and where it starts in the plain tensor
Chunk = tuple[torch.Tensor, tuple[int, ...]]


@dataclass(frozen=True)
class Part:
    """Where a local tensor's elements of one plain tensor lie. ``cut`` maps a local tensor laid out like
    the held one (its weights, or an AdamW moment of them) to its chunks; ``divided``: the ranks hold
    different chunks (written as a DTensor), else every holder holds all of it (a plain tensor)."""

    name: str  # the plain model's name
    cut: Callable[[torch.Tensor], list[Chunk]]
    divided: bool


@dataclass(frozen=True)
class Held:
    """A tensor the optimizer steps (a parameter, or ZeRO's flat master shard) and the plain tensors it
    holds parts of; ``loaded`` runs after a ``dcp.load`` into it; ``placement`` says whether it counts."""

    tensor: torch.Tensor
    parts: tuple[Part, ...]
    loaded: Callable[[], None] | None = None
    placement: Placement | None = None


@dataclass(frozen=True)
class PlainLayout:
    """What every layout's state dict is keyed by: the plain model's state-dict keys and shapes (tied
    parameters under all their keys), the parameter each key is (a tied key → the parameter's first
    name, AdamW's state key), and the optimizer groups' parameter names in the one-process order."""

    shapes: dict[str, torch.Size]
    canonical: dict[str, str]
    group_names: list[list[str]] = field(default_factory=list)

    @classmethod
    def of(cls, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> PlainLayout:
        """From the plain ``model`` (the meta device will do) and an optimizer built over it."""
        names = {id(p): n for n, p in model.named_parameters()}  # a tied parameter: its first name
        named = model.state_dict(keep_vars=True)
        canonical = {key: names.get(id(value), key) for key, value in named.items()}
        groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups] if optimizer else []
        return cls({k: v.shape for k, v in named.items()}, canonical, groups)

    def keys_of(self, name: str) -> list[str]:
        """Every state-dict key of the parameter ``name`` is (itself, and the keys tied to it)."""
        first = self.canonical[name]
        return [key for key, value in self.canonical.items() if value == first]


def plain_chunks(
    chunks: Iterable[Chunk],
    local_shape: Sequence[int],
    placement: Placement,
    plain: Sequence[int],
    tp_rank: int,
) -> list[Chunk]:
    """``chunks`` of a local tensor (offsets in it) placed in the plain tensor of shape ``plain``: a
    tensor-parallel shard (``placement.tp_dim``) is slice ``tp_rank`` along that dimension, clipped to the
    plain size (the vocabulary's padding rows are dropped); anything else lies as it is."""
    dim = placement.tp_dim
    if dim is None:
        return list(chunks)
    result = []
    for view, offsets in chunks:
        start = list(offsets)
        start[dim] += tp_rank * local_shape[dim]
        size = min(view.shape[dim], plain[dim] - start[dim])
        if size > 0:
            result.append((view.narrow(dim, 0, size), tuple(start)))
    return result


def held_parameters(
    placements: Iterable[tuple[nn.Parameter, Placement]], plain: PlainLayout, tp_rank: int
) -> list[Held]:
    """Whole local parameters (replicated, a tp shard, a stage's, an expert's, a tied copy), each one chunk
    placed by its :class:`Placement` (:func:`plain_chunks`)."""
    held = []
    for param, placement in placements:
        shape = plain.shapes[placement.name]

        def cut(tensor: torch.Tensor, p: Placement = placement, s: torch.Size = shape) -> list[Chunk]:
            return plain_chunks([(tensor, (0,) * tensor.dim())], tensor.shape, p, s, tp_rank)

        part = Part(placement.name, cut, divided=placement.tp_dim is not None)
        held.append(Held(param, (part,), placement=placement))
    return held


def sharded_state_dict(
    held: Sequence[Held], optimizer: torch.optim.Optimizer, module: nn.Module, plain: PlainLayout
) -> dict[str, Any]:
    """``{"model": …, "optim": {"state": …, "param_groups": …}}`` under the plain model's names, every
    tensor a view of what this rank holds, with ``module``'s persistent buffers; the optimizer's state is
    created first (zeros) so a fresh run has views to load into (:func:`finish_load` completes a load)."""
    init_optimizer_state(optimizer)
    model: dict[str, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    for entry in held:
        slots = optimizer.state[entry.tensor]
        for part in entry.parts:
            key = plain.canonical[part.name]
            shape = plain.shapes[key]
            weights = _stored(part, entry.tensor.detach(), shape)
            for alias in plain.keys_of(key):
                model[alias] = weights
            state[key] = {
                slot: _stored(part, value.detach(), shape) if _per_element(value, entry.tensor) else value
                for slot, value in slots.items()
            }
    for key, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, nn.Parameter):
            model[key] = value.detach()
    param_groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": names}
        for group, names in zip(optimizer.param_groups, plain.group_names, strict=True)
    ]
    return {"model": model, "optim": {"state": state, "param_groups": param_groups}}


def finish_load(held: Sequence[Held]) -> None:
    """After ``dcp.load`` wrote a checkpoint (of any layout) into :func:`sharded_state_dict`'s views: each
    Held's finishing step. The hyper-parameters stay this run's (its flags and schedule set them)."""
    for entry in held:
        if entry.loaded is not None:
            entry.loaded()


@torch.no_grad()
def gather_plain(
    held: Sequence[Held], plain: PlainLayout, coordinates: Mapping[str, int], job: Communicator
) -> dict[str, torch.Tensor]:
    """Collective over ``job``: the plain model's parameters, whole, on every rank, keyed like its state
    dict (tied keys share a tensor; buffers are a fresh plain model's own). Each rank writes the chunks of
    the Held it counts into float32 zeros and one all-reduce sums them."""
    keys = [name for names in plain.group_names for name in names]  # every parameter, once
    sizes = [plain.shapes[key].numel() for key in keys]
    device = held[0].tensor.device if held else torch.device("cpu")
    flat = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
    whole = {key: piece.view(plain.shapes[key]) for key, piece in zip(keys, flat.split(sizes), strict=True)}
    for entry in held:
        if entry.placement is not None and not entry.placement.counted_at(coordinates):
            continue
        for part in entry.parts:
            target = whole[plain.canonical[part.name]]
            for view, offsets in part.cut(entry.tensor.detach()):
                box = tuple(
                    slice(start, start + size) for start, size in zip(offsets, view.shape, strict=True)
                )
                target[box].copy_(view)
    job.all_reduce(flat, ReduceOp.SUM)
    return {key: whole[plain.canonical[key]] for key in plain.shapes if plain.canonical[key] in whole}


def _per_element(value: Any, held: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == held.shape


def _stored(part: Part, tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """What DCP is given for ``part`` of ``tensor``: the view itself when every holder holds all of it,
    else a DTensor of its chunks."""
    chunks = part.cut(tensor)
    if not part.divided:
        ((view, _),) = chunks
        return view
    return as_dtensor(chunks, shape, tensor)


def as_dtensor(chunks: Sequence[Chunk], shape: torch.Size, like: torch.Tensor) -> DTensor:
    """A DTensor of global ``shape`` whose local pieces are ``chunks`` (views, written and read in place)
    of a tensor ``like``. Its 1-D mesh over the job only describes (the chunks' offsets say which part;
    DCP never asks the mesh's process groups), so it is built without any — creating them is collective.
    Built from its spec: ``DTensor.from_local`` would view the pieces as one tensor and refuse pieces of a
    tensor of more than two dimensions (a convolution's weight)."""
    local = [view for view, _ in chunks]
    offsets = [offset for _, offset in chunks]
    if not local:  # DCP mishandles a key some rank holds nothing of (it then reads nested keys the
        # pre-2.4 way and misses them), so an empty chunk at the far corner, where no real chunk starts
        local.append(like.new_empty([0] * len(shape)))
        offsets.append(tuple(shape))
    pieces = LocalShardsWrapper(local, offsets)
    world = torch.arange(dist.get_world_size())
    mesh = DeviceMesh(pieces.device.type, world, _init_backend=False, _rank=dist.get_rank())
    meta = TensorMeta(shape, torch.empty(shape, device="meta").stride(), like.dtype)
    return DTensor(pieces, DTensorSpec(mesh, (Shard(0),), tensor_meta=meta), requires_grad=False)
