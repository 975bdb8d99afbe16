"""ZeRO's flat shards described for the one checkpoint writer (:mod:`meshwise.parallel.state_dict`).

A flat master shard cuts parameters at arbitrary element offsets, so this rank's piece of a parameter is
the few rectangular boxes covering its range (:func:`~.layout.boxes`), computed from the layout every
rank knows: no metadata is exchanged, padding is never written, and no rank ever holds a whole tensor —
the point of ZeRO when a model does not fit. Each flat group is one
:class:`~meshwise.parallel.state_dict.Held` whose parts are its parameters' rectangles: views of the
master shard (and of each AdamW moment, laid out alike), placed in the plain parameter by the parameter's
:class:`~meshwise.parallel.placement.Placement` (a tensor-parallel shard's rectangles move to its slice).
A load writes into the master shards and its ``loaded`` step refreshes the compute copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch

from meshwise.parallel.placement import Placement, place
from meshwise.parallel.state_dict import Chunk, Held, Part, PlainLayout, plain_chunks
from meshwise.parallel.zero.flat import FlatGroup
from meshwise.parallel.zero.layout import boxes
from meshwise.parallel.zero.sharded import ShardedModel


def zero_held(
    zero: ShardedModel,
    plain: PlainLayout | None = None,
    tp_rank: int = 0,
    group_placements: Sequence[Placement] | None = None,
) -> list[Held]:
    """Every flat group of ``zero`` as the rectangles of its range of each parameter. ``plain``: the plain
    model's shapes (default: the local parameters' own); ``tp_rank``: this rank's tp coordinate, where
    each tensor-parallel shard's rectangles move to; ``group_placements``: each flat group's (its
    shard's axes, for a gather's counting)."""
    # a step's refresh started all-gathers (stages 1/2) whose input is this rank's slot of the full
    # buffer — the master shard a load writes into: they must land first, or one landing after the load
    # puts the pre-load values back into the slot
    zero.wait_gathered()
    placements = place(zero.module.named_parameters())
    held = []
    for index, (group, names) in enumerate(zip(zero.groups, zero.param_names, strict=True)):
        parts = []
        for at, (name, param) in enumerate(zip(names, group.params, strict=True)):
            shape = plain.shapes[name] if plain is not None else param.shape
            cut = partial(_rectangles, group, at, placements[name], tuple(shape), tp_rank)
            parts.append(Part(name, cut, divided=True))
        where = group_placements[index] if group_placements is not None else None
        held.append(Held(group.master, tuple(parts), loaded=group.refresh, placement=where))
    return held


def zero_layout(zero: ShardedModel, optimizer: torch.optim.Optimizer) -> PlainLayout:
    """The plain layout of ``zero``'s own module (not cut by any other strategy), each optimizer group
    naming the parameters of the flat groups it steps."""
    plain = PlainLayout.of(zero.module)
    held = {id(g.master): names for g, names in zip(zero.groups, zero.param_names, strict=True)}
    groups = [[n for m in group["params"] for n in held[id(m)]] for group in optimizer.param_groups]
    return PlainLayout(plain.shapes, plain.canonical, groups)


def _rectangles(
    group: FlatGroup,
    index: int,
    placement: Placement,
    plain: tuple[int, ...],
    tp_rank: int,
    flat: torch.Tensor,
) -> list[Chunk]:
    """Parameter ``index``'s boxes of ``flat`` (this rank's shard of a parameter-shaped quantity: the
    master, a moment), offsets in the plain parameter."""
    local = tuple(group.params[index].shape)
    chunks: list[Chunk] = []
    for piece in (p for p in group.layout.pieces(group.comm.rank) if p.param == index):
        for box in boxes(local, piece.param_start, piece.param_start + piece.numel):
            begin = piece.shard_start + box.flat_start - piece.param_start
            chunks.append((flat[begin : begin + box.numel].view(box.sizes), box.offsets))
    return plain_chunks(chunks, local, placement, plain, tp_rank)
