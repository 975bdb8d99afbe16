"""Split sizes of an uneven all-to-all: cutting a tensor by them, and checking that all ranks' agree.

In ``all_to_all_single`` (torch's semantics) rank i sends ``input_split_sizes[j]`` rows to rank j, and
rank j must expect exactly that many from i in its ``output_split_sizes[i]``. A rank can check only its
own arguments locally; whether the pairs match needs every rank's table. The transports differ in what a
mismatch does — gloo aborts the whole process, MPI truncates or leaves data unwritten — so each backend
brings the tables together and raises the same :class:`CollectiveMismatchError` on every rank, naming
the pair, before any data moves. Plain functions, testable without processes.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch


def split_sizes(
    sizes: Sequence[int] | torch.Tensor | None, rows: int, world_size: int, what: str, rank: int
) -> list[int]:
    """``sizes`` checked against a tensor of ``rows`` rows (``None``: an even split), as a list of ints."""
    op = "all_to_all_single"
    if sizes is None:
        if rows % world_size:
            raise ValueError(
                f"[rank {rank} · {op}] {what} has {rows} rows, not divisible by the world size {world_size}; "
                f"pass {what}_split_sizes"
            )
        return [rows // world_size] * world_size
    given = sizes.tolist() if isinstance(sizes, torch.Tensor) else list(sizes)
    try:
        values = [operator.index(v) for v in given]  # ints, numpy integers, 0-d integer tensors
    except TypeError:
        values = given
    if len(values) != world_size or not all(isinstance(v, int) and v >= 0 for v in values):
        raise ValueError(
            f"[rank {rank} · {op}] {what}_split_sizes={values} must be {world_size} non-negative integers "
            "(one per rank)"
        )
    if sum(values) != rows:
        raise ValueError(
            f"[rank {rank} · {op}] {what}_split_sizes add up to {sum(values)} rows but {what} has {rows} "
            "along dim 0"
        )
    return values


def first_mismatch(sends: Sequence[Sequence[int]], recvs: Sequence[Sequence[int]], op: str) -> str | None:
    """The sentence naming the first pair that disagrees (``sends[i][j]``: what rank i sends to j,
    ``recvs[j][i]``: what rank j expects from i), or None when every pair agrees."""
    for i, row in enumerate(sends):
        for j, sent in enumerate(row):
            expected = recvs[j][i]
            if sent != expected:
                return (
                    f"rank {i} sends {sent} elements to rank {j} but rank {j} expects {expected} from "
                    f"rank {i} (check the {op} split sizes of both ranks)"
                )
    return None
