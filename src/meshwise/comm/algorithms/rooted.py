"""Scatter and gather by plan (binomial tree or linear), including the size exchange uneven slots need.

A non-root rank knows only its own slot size, but a tree relays whole subtrees, so before a tree
scatter the root sends each subtree's sizes down the same tree (an int64 vector, one entry per rank),
and before a tree gather every rank sends its subtree's sizes up. The root checks that the sizes it
learns match its own slots and every rank that the size it receives matches its buffer, turning a
mismatched call into a :class:`CollectiveMismatchError` instead of a corrupted or aborted transfer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from meshwise.comm.algorithms import tree
from meshwise.comm.algorithms.plan import Plan
from meshwise.comm.algorithms.registry import build_plan
from meshwise.comm.api import CollectiveMismatchError

Runner = Callable[[Plan, dict[str, torch.Tensor]], None]


def _slot_counts(
    run: Runner,
    rank: int,
    p: int,
    algo: str,
    collective: str,
    root: int,
    own: int,
    slots: list[torch.Tensor] | None,
) -> tuple[list[int], list[int]]:
    """(order, counts): the ranks in slot order, and the slot sizes this rank's plan needs — all of them
    on the root (``slots``), its subtree's on a tree (exchanged first), only its own (``own``) otherwise."""
    order = tree.relative_order(p, root) if algo == "tree" else list(range(p))
    if rank == root:
        assert slots is not None
        counts = [slots[r].numel() for r in order]
        if algo == "tree":
            subtree_counts(run, rank, p, collective, root, own, expected=counts)
    elif algo == "tree":
        counts = subtree_counts(run, rank, p, collective, root, own)
    else:
        counts = [own if r == rank else 0 for r in range(p)]
    return order, counts


def scatter(
    run: Runner, rank: int, p: int, algo: str, output: Tensor, inputs: list[Tensor] | None, root: int
) -> None:
    order, counts = _slot_counts(run, rank, p, algo, "scatter", root, output.numel(), inputs)
    if inputs is not None and rank == root:
        data = torch.cat([inputs[r].reshape(-1) for r in order])
    else:
        data = torch.empty(sum(counts), dtype=output.dtype, device=output.device)
    run(build_plan("scatter", algo, rank, p, tuple(counts), root), {"data": data})
    start = sum(counts[: order.index(rank)]) if rank == root else 0
    output.view(-1).copy_(data[start : start + output.numel()])


def gather(
    run: Runner, rank: int, p: int, algo: str, input: Tensor, outputs: list[Tensor] | None, root: int
) -> None:
    order, counts = _slot_counts(run, rank, p, algo, "gather", root, input.numel(), outputs)
    data = torch.empty(sum(counts), dtype=input.dtype, device=input.device)
    start = sum(counts[: order.index(rank)]) if rank == root else 0
    data[start : start + input.numel()] = input.reshape(-1)
    run(build_plan("gather", algo, rank, p, tuple(counts), root), {"data": data})
    if outputs is not None and rank == root:
        for r, piece in zip(order, data.split(counts), strict=True):
            outputs[r].view(-1).copy_(piece)


def subtree_counts(
    run: Runner, rank: int, p: int, collective: str, root: int, own: int, expected: list[int] | None = None
) -> list[int]:
    """Slot sizes of this rank's subtree (root-relative order, zeros elsewhere), exchanged through the
    tree ahead of a scatter (sizes flow down) or a gather (sizes flow up). The root passes ``expected``."""
    v = (rank - root) % p
    width = p if expected is not None else tree.subtree_size(rank, p, root)
    if expected is not None:
        buf = torch.tensor(expected, dtype=torch.int64)
    else:
        buf = torch.zeros(width, dtype=torch.int64)
        if collective == "gather":
            buf[0] = own
    plan = tree.counts_plan_scatter if collective == "scatter" else tree.counts_plan_gather
    run(plan(rank, p, root), {"counts": buf})
    if expected is not None and buf.tolist() != expected:
        raise CollectiveMismatchError(
            f"ranks announced slot sizes {buf.tolist()} (root-relative order) but the root's slots hold "
            f"{expected}",
            rank=rank,
            op=collective,
        )
    if collective == "scatter" and int(buf[0]) != own:
        raise CollectiveMismatchError(
            f"the root sends {int(buf[0])} elements but this rank's output holds {own}",
            rank=rank,
            op=collective,
        )
    counts = [0] * p
    counts[v : v + width] = buf.tolist()
    return counts
