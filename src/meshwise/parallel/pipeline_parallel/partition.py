"""Cut a model into pipeline chunks along its plan: the first modules, runs of layers, the last modules.

Chunk ``c`` of ``C = p·v`` holds a run of the plan's repeated layers; chunk 0 also the modules the plan
runs first (a GPT's embeddings), chunk ``C−1`` the ones it runs last (final norm and head). Layers are
balanced by parameter count, the first and last modules weighing on the end chunks (a large vocabulary
gives those fewer layers), or given explicitly. :class:`~meshwise.parallel.plan.ParallelPlan` says what
to cut: nothing here knows a particular model.

A plan's *tied* parameters (a head tied to the token embedding) are one tensor in the plain model. When
the first and last chunks live on different ranks each holds its own copy (same initial values);
:func:`tied_parameters` names the pair so the executor sums their gradients after the backward, and
identical optimizer updates keep them equal (as Megatron-LM does for its word embeddings). Names inside a
chunk are the full model's (``blocks.3.attn.q.weight``), so checkpoints and parity tests map chunk
parameters to the model's one to one.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Sequence

import torch
from torch import nn

from meshwise.parallel.plan import ParallelPlan


class LayerChunk(nn.Module):
    """A contiguous slice of a model: ``forward`` maps its input or hidden states to hidden states or its
    output. The plan's modules and layers are attributes under the model's own names."""

    def __init__(
        self,
        model: nn.Module,
        plan: ParallelPlan,
        start: int,
        end: int,
        *,
        first: bool,
        last: bool,
        tied_here: bool,
        sequence_shards: int = 1,
    ) -> None:
        super().__init__()
        self.plan = plan
        self.first, self.last = first, last
        self.sequence_shards = sequence_shards
        if first:
            for name in plan.first:
                setattr(self, name, model.get_submodule(name))
        layers = plan.layer_modules(model)
        setattr(self, plan.layers, nn.ModuleDict({str(i): layers[i] for i in range(start, end)}))
        if last:
            copies = {} if tied_here else {b: a for a, b in plan.tied}
            for name in plan.last:
                module = model.get_submodule(name)
                for param_name in [p for p in copies if p.rpartition(".")[0] == name]:
                    module = _own_copy(module, param_name.rpartition(".")[2])
                setattr(self, name, module)

    @property
    def layers(self) -> nn.ModuleDict:
        return getattr(self, self.plan.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.plan.enter(self, x)
        for layer in self.layers.values():
            x = layer(x)
        if self.last:
            x = self.plan.leave(self, x)
        return x

    def output_shape(self, input_shape: torch.Size) -> torch.Size:
        """Shape of the hidden states this chunk hands to the next; with sequence parallelism (the first
        chunk's embedding splits the sequence) the sequence dimension is this rank's shard of it."""
        if not self.first:
            return input_shape
        shape = list(self.plan.activation_shape(input_shape))
        shape[-2] //= self.sequence_shards
        return torch.Size(shape)


def _own_copy(module: nn.Module, attr: str) -> nn.Module:
    """``module`` with its parameter ``attr`` replaced by a copy of equal value (for the last stage's end
    of a tied pair): a shallow copy of the module, so layer state such as a tensor-parallel communicator is
    shared, not duplicated; the parameter's marks (e.g. its tensor-parallel shard dimension) are kept."""
    clone = copy.copy(module)
    clone._parameters = dict(module._parameters)
    source = module._parameters[attr]
    assert source is not None
    param = nn.Parameter(source.detach().clone(), requires_grad=source.requires_grad)
    for key, value in vars(source).items():
        if not key.startswith("_"):
            setattr(param, key, value)
    setattr(clone, attr, param)
    return clone


def block_weights(model: nn.Module, plan: ParallelPlan) -> tuple[list[int], int, int]:
    """Parameters of each layer, of the first modules and of the last modules (balancing weights)."""

    def count(names: Sequence[str]) -> int:
        return sum(p.numel() for name in names for p in model.get_submodule(name).parameters())

    layers = [sum(p.numel() for p in layer.parameters()) for layer in plan.layer_modules(model)]
    return layers, count(plan.first), count(plan.last)


def balanced_split(
    weights: Sequence[int], chunks: int, *, first_extra: int = 0, last_extra: int = 0
) -> list[int]:
    """Blocks per chunk (contiguous, each ≥ 1) minimising the heaviest chunk; ties favour early chunks."""
    n = len(weights)
    check_layers(n, chunks)
    prefix = [0, *itertools.accumulate(weights)]

    def load(c: int, i: int, j: int) -> int:
        extra = (first_extra if c == 0 else 0) + (last_extra if c == chunks - 1 else 0)
        return prefix[j] - prefix[i] + extra

    @functools.cache
    def best(c: int, j: int) -> tuple[float, int]:
        """The smallest possible heaviest chunk when chunks 0..c−1 hold blocks [0, j), and where chunk
        c−1 then starts (the earliest of equals)."""
        if c == 0:
            return (0 if j == 0 else float("inf"), 0)
        return min((max(best(c - 1, i)[0], load(c - 1, i, j)), i) for i in range(c - 1, j))

    sizes, j = [], n
    for c in range(chunks, 0, -1):
        start = best(c, j)[1]
        sizes.append(j - start)
        j = start
    return sizes[::-1]


def check_layers(layers: int, chunks: int) -> None:
    if layers < chunks:
        raise ValueError(
            f"{layers} layers cannot be cut into {chunks} pipeline chunks (pp × virtual stages): every chunk "
            f"needs at least one block; lower --pp or --virtual-stages, or use a deeper model"
        )


def partition(
    model: nn.Module,
    plan: ParallelPlan,
    stages: int,
    virtual_stages: int = 1,
    layers_per_chunk: Sequence[int] | None = None,
    *,
    in_place: bool = False,
    sequence_shards: int = 1,
) -> list[LayerChunk]:
    """Every chunk of ``model`` (chunk c runs on rank c % stages), cut from a copy of it.

    ``layers_per_chunk`` fixes the layers of each chunk explicitly; by default they are balanced by
    parameter count. ``in_place=True`` cuts ``model`` itself: for a tensor-parallel model, whose layers
    hold a communicator that must not be copied. ``sequence_shards`` is the tp size under sequence
    parallelism (chunks then hand over their rank's shard of the sequence).
    """
    chunks = stages * virtual_stages
    layers = len(plan.layer_modules(model))
    if layers_per_chunk is None:
        blocks, first, last = block_weights(model, plan)
        sizes = balanced_split(blocks, chunks, first_extra=first, last_extra=last)
    else:
        sizes = list(layers_per_chunk)
        check_layers(layers, chunks)
        if len(sizes) != chunks or sum(sizes) != layers or min(sizes) < 1:
            raise ValueError(
                f"layers per chunk {sizes} must be {chunks} positive counts (pp × virtual stages) summing to "
                f"the model's {layers} layers"
            )
    if not in_place:
        model = copy.deepcopy(model)
    ends = list(itertools.accumulate(sizes))
    return [
        LayerChunk(
            model,
            plan,
            a,
            b,
            first=c == 0,
            last=c == chunks - 1,
            tied_here=stages == 1,
            sequence_shards=sequence_shards,
        )
        for c, (a, b) in enumerate(zip([0, *ends[:-1]], ends, strict=True))
    ]


def chunks_of_rank(chunks: Sequence[LayerChunk], rank: int, stages: int) -> list[LayerChunk]:
    """The chunks rank ``rank`` runs, in order: ``rank``, ``rank + p``, ``rank + 2p`` …"""
    return list(chunks[rank::stages])


def chunk_parameters(chunks: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The distinct parameters of a rank's chunks, for its optimizer: with one stage the head of the last
    chunk *is* the embedding of the first, and an optimizer given it twice would step it twice."""
    return list({id(p): p for c in chunks for p in c.parameters()}.values())


def tied_parameters(local: Sequence[LayerChunk]) -> list[nn.Parameter]:
    """This rank's copies of the plan's tied parameters when the two ends are on different ranks."""
    firsts = [c for c in local if c.first]
    lasts = [c for c in local if c.last]
    if firsts and lasts:
        return []  # one rank holds both ends: the tie is a shared Parameter already
    return [c.get_parameter(a) for c in firsts for a, _ in c.plan.tied] + [
        c.get_parameter(b) for c in lasts for _, b in c.plan.tied
    ]
