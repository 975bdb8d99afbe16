"""Which parameters are flattened together, in which order: the sharding plan as plain data.

A *group* is one flat vector sharded over the ranks (one all-gather, one reduce-scatter). Groups never
mix trainable and frozen parameters (frozen ones have no gradient to reduce and must not reach the
optimizer), dtypes, nor the keys of a caller's ``separate_by`` — so an optimizer can treat kinds apart
exactly (AdamW decaying matrices but not biases), each flat shard belonging to one param group.

- Stages 1 and 2 keep every parameter gathered, so a group is only a communication bucket, planned as
  DataParallel's (reverse parameter order, small first bucket: the first reduce-scatter starts while
  backward is still busy with the early layers).
- Stage 3 gathers parameters unit by unit: a unit is a module (each parameter-holding child by default, or
  the caller's list — a model's plan gives its repeated layers). Everything no unit owns, and any
  parameter two units use, belongs to the *root*, gathered from the start of forward to the end of
  backward.

Groups are listed in the order their gradients become ready (the order reduce-scatters are launched in,
identical on every rank): for stage 3 the last unit first and the root last.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from torch import nn

from meshwise.parallel.data_parallel.buckets import plan_buckets

ROOT = 0  # unit index of the root

#: A caller's key for a parameter (name, parameter): parameters of different keys never share a group.
SeparateBy = Callable[[str, nn.Parameter], Hashable]


@dataclass(frozen=True)
class GroupPlan:
    """One flat group: parameter names (module order) and the unit that gathers them."""

    names: tuple[str, ...]
    unit: int = ROOT


def default_units(model: nn.Module) -> list[nn.Module]:
    """Stage 3's units when none are given: the parameter-holding children, with ModuleLists and
    Sequentials opened up (so a layer stack shards layer by layer)."""
    units: list[nn.Module] = []
    for child in model.children():
        if isinstance(child, nn.ModuleList | nn.Sequential):
            units.extend(default_units(child) if len(child) else [])
        elif any(True for _ in child.parameters()):
            units.append(child)
    return units


def plan_stage3(
    model: nn.Module, units: Sequence[nn.Module], separate_by: SeparateBy | None = None
) -> list[GroupPlan]:
    """Groups per unit (index 1.. in forward order), root (index 0) last, in gradient-ready order. A unit
    that is not a module of ``model`` is refused."""
    inside = {id(module) for module in model.modules()}
    for index, unit in enumerate(units):
        if not isinstance(unit, nn.Module):
            raise TypeError(f"units[{index}] is a {type(unit).__name__}, not an nn.Module")
        if unit is model or id(unit) not in inside:
            raise ValueError(
                f"units[{index}] ({type(unit).__name__}) is not a submodule of the model being sharded: "
                "pass modules taken from the model itself (e.g. list(model.blocks))"
            )
    named = dict(model.named_parameters())
    owner_of: dict[str, int] = {}
    by_id = {id(p): name for name, p in named.items()}
    for index, unit in enumerate(units, start=1):
        for param in unit.parameters():
            name = by_id[id(param)]
            owner_of[name] = ROOT if name in owner_of and owner_of[name] != index else index
    plans = []
    for unit in [*range(len(units), 0, -1), ROOT]:
        members = [name for name in named if owner_of.get(name, ROOT) == unit]
        plans.extend(_split(members, named, unit, separate_by))
    return plans


def plan_buckets_as_groups(
    model: nn.Module, bucket_bytes: int, first_bucket_bytes: int, separate_by: SeparateBy | None = None
) -> list[GroupPlan]:
    """Stages 1/2: trainable parameters in DataParallel's buckets (each split by ``separate_by``), frozen
    ones in groups of their own."""
    named = list(model.named_parameters())
    trainable = [(name, p) for name, p in named if p.requires_grad]
    plans = []
    if trainable:
        for bucket in plan_buckets([p for _, p in trainable], bucket_bytes, first_bucket_bytes):
            members = sorted(bucket.params)  # module order inside the flat vector
            plans.extend(_split([trainable[i][0] for i in members], dict(named), ROOT, separate_by))
    frozen = [name for name, p in named if not p.requires_grad]
    plans.extend(_split(frozen, dict(named), ROOT, separate_by))
    return plans


def _split(
    names: list[str], named: dict[str, nn.Parameter], unit: int, separate_by: SeparateBy | None
) -> list[GroupPlan]:
    """Trainable and frozen members of one unit as separate groups, each of a single dtype, device and
    caller's key."""
    keyed: dict[tuple, list[str]] = {}
    for name in names:
        param = named[name]
        mine = separate_by(name, param) if separate_by is not None else None
        key = (not param.requires_grad, str(param.dtype), str(param.device), mine)
        keyed.setdefault(key, []).append(name)
    return [GroupPlan(tuple(members), unit) for members in keyed.values()]
