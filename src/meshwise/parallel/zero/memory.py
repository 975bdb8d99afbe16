"""Per-rank memory of sharded training, measured from the tensors held, and the ZeRO formulas.

The ZeRO paper counts, per parameter, ``b_p`` bytes of parameters and ``b_g`` of gradients in the
compute precision and ``K`` bytes of optimizer state (mixed-precision Adam: a float32 master copy plus two
float32 moments, K = 12; full-precision Adam: K = 8, the parameter being its own master). Stage 1 divides
the optimizer state by N, stage 2 also the gradients, stage 3 also the parameters (the table in
docs/zero.md). The report matches :func:`zero_formula` *exactly* once Ψ/N is read as the elements a rank
really holds — Σ⌈Ψ_g/N⌉ over flat groups g — and Ψ as N times that: padding adds fewer than N elements per
group, a rounding the paper ignores. A model whose experts are sharded over their own replicas is the sum
of the table over its groups, each with its own Ψ and N.

Optimizer state counts the per-element tensors (Adam's moments, SGD's momentum) and a separate master
copy; scalar state such as Adam's step counter is left out, as the formulas leave it out.
``peak_gathered`` is the most bytes of transient full-size buffers (gathered parameters, unsharded
gradients) alive at once since the last :meth:`Tracker.reset_peak`; activations are not counted.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from meshwise.parallel.zero.sharded import ShardedModel


@dataclass(frozen=True)
class MemoryReport:
    """Bytes one rank holds between steps, by kind, and the transient peak during a step."""

    shard_numel: int  # elements this rank holds of every group (Σ⌈Ψ_g/N⌉); Ψ = N · shard_numel
    parameters: int
    gradients: int
    optimizer_state: int
    peak_gathered: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    def line(self) -> str:
        return (
            f"parameters {format_bytes(self.parameters)}, gradients {format_bytes(self.gradients)}, "
            f"optimizer state {format_bytes(self.optimizer_state)} (total {format_bytes(self.total)}), "
            f"peak gathered {format_bytes(self.peak_gathered)}"
        )


def format_bytes(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number ≥ 1 (B, KiB, MiB, GiB)."""
    for unit in ("B", "KiB", "MiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} B" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} GiB"


def zero_formula(
    stage: int, shard_numel: int, world_size: int, *, param_bytes: int, grad_bytes: int, k: int
) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state) bytes per rank by the ZeRO paper's table (stage 0: DDP)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0..3, got {stage}")
    full, part = shard_numel * world_size, shard_numel
    return (
        param_bytes * (part if stage == 3 else full),
        grad_bytes * (part if stage >= 2 else full),
        k * (part if stage >= 1 else full),
    )


def _storage(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.untyped_storage().data_ptr()


def measure(model: ShardedModel, optimizer: torch.optim.Optimizer | None) -> MemoryReport:
    """The report of ``model`` (and of ``optimizer``'s state for its shards, when given)."""
    parameters = gradients = optimizer_state = 0
    for group in model.groups:
        if group.persistent:
            parameters += group.full.untyped_storage().nbytes()
        elif group.compute_shard is not None:
            parameters += group.compute_shard.untyped_storage().nbytes()
        if group.trainable:
            kept = group.flat_grad if model.stage == 1 else group.grad_shard
            gradients += 0 if kept is None else kept.untyped_storage().nbytes()
        master = group.master
        if _storage(master) not in (_storage(group.full), _storage(group.compute_shard)):
            optimizer_state += master.untyped_storage().nbytes()
        if optimizer is not None:
            for value in optimizer.state.get(master, {}).values():
                if isinstance(value, torch.Tensor) and value.numel() == master.numel():
                    optimizer_state += value.numel() * value.element_size()
    return MemoryReport(
        shard_numel=sum(g.layout.shard_numel for g in model.groups),
        parameters=parameters,
        gradients=gradients,
        optimizer_state=optimizer_state,
        peak_gathered=model.tracker.peak,
    )


def rank_lines(model: ShardedModel, optimizer: torch.optim.Optimizer | None, k: int) -> list[str]:
    """Collective over ``model.comm``: every rank's report, one line each (for rank 0 to print), and the
    ZeRO formula's line beside them for ``k`` optimizer-state bytes per element (master copy included)."""
    device, world_size = model.groups[0].device, model.comm.world_size
    mine = torch.tensor(astuple(measure(model, optimizer)), dtype=torch.int64, device=device)
    every = torch.zeros(world_size * mine.numel(), dtype=torch.int64, device=device)
    model.comm.all_gather(every, mine)
    lines = [
        f"rank {r}: {MemoryReport(*v).line()}" for r, v in enumerate(every.view(world_size, -1).tolist())
    ]
    # the table per flat group (each sharded over its own replicas' N), summed
    param_bytes = model.groups[0].full.element_size()
    grad_bytes = torch.empty((), dtype=model.groups[0].grad_dtype).element_size()
    parts = [
        zero_formula(model.stage, group.layout.shard_numel, group.comm.world_size,
                     param_bytes=param_bytes, grad_bytes=grad_bytes, k=k)
        for group in model.groups
    ]  # fmt: skip
    p, g, o = (sum(column) for column in zip(*parts, strict=True))
    worlds = [f"N = {model.comm.world_size}"]
    if 1 in model.replica_of:
        worlds.append(f"experts N = {model.replica_comms[1].world_size}")
    lines.append(
        f"formula: parameters {format_bytes(p)}, gradients {format_bytes(g)}, optimizer state "
        f"{format_bytes(o)} (total {format_bytes(p + g + o)}; stage {model.stage}, "
        f"{param_bytes}+{grad_bytes}+{k} bytes per parameter, {', '.join(worlds)})"
    )
    return lines
