"""What one collective call looks like, and whether the calls of all ranks can meet.

A mismatched collective (one rank calls ``all_reduce`` while another calls ``broadcast``, or the same op
with another size, dtype or root) is the commonest cause of a distributed hang: the transports cannot tell
and simply wait. A :class:`Fingerprint` is the part of a call every rank must agree on, plus the caller's
``file:line`` to name it; :func:`find_mismatch` compares the fingerprints of all ranks of one collective
and returns the sentence that explains the disagreement. Plain data, testable without processes.

Counts are compared, not shapes: NCCL, MPI and our transports move ``numel`` elements, so an all_reduce
of a ``[4, 8]`` tensor meets one of ``[32]``. The call site is reported, never compared: ranks may call the
same collective from different lines (``if rank == 0: ... else: ...``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from meshwise.comm.api import Collective

#: Frames inside these directories are library plumbing; the call site is the first frame outside.
_PLUMBING = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # meshwise/
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)
_COMM_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
#: Collectives whose single tensor holds the same number of elements on every rank.
_SAME_COUNT = (Collective.BROADCAST, Collective.REDUCE, Collective.ALL_REDUCE)


#: file name -> whether it is plumbing (inside meshwise or torch), and -> how it is shown.
_plumbing: dict[str, bool] = {}
_comm: dict[str, bool] = {}
_shown: dict[str, str] = {}


def call_site() -> str:
    """``file:line`` of the user's code that led to this call.

    The first frame outside meshwise and torch (so a DDP gradient hook reports the line of
    ``loss.backward()``), else the first frame outside ``meshwise/comm`` (meshwise's own callers).
    Every collective pays for this walk, so each file's verdict is looked up, not recomputed.
    """
    frame = sys._getframe(1)
    fallback = None
    while frame is not None:
        name = frame.f_code.co_filename
        plumbing = _plumbing.get(name)
        if plumbing is None:
            plumbing = _plumbing[name] = name.startswith(_PLUMBING)
            _comm[name] = name.startswith(_COMM_DIR)
        if not plumbing:
            return f"{_short(name)}:{frame.f_lineno}"
        if fallback is None and not _comm[name]:
            fallback = f"{_short(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback or "<unknown>"


def _short(filename: str) -> str:
    """A path relative to the working directory (when the file was first seen) if below it, else the
    file name."""
    shown = _shown.get(filename)
    if shown is None:
        cwd = os.getcwd() + os.sep
        shown = _shown[filename] = (
            filename[len(cwd) :] if filename.startswith(cwd) else os.path.basename(filename)
        )
    return shown


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:  # str(dtype) costs microseconds: once per dtype
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


@dataclass(slots=True)
class Fingerprint:
    """One rank's view of collective number ``seq`` of a group."""

    seq: int
    op: str  # a Collective, or barrier / split / close / send / recv
    dtype: str | None = None
    shape: tuple[int, ...] | None = None  # the main tensor, for the message
    count: int | None = None  # elements of the main tensor
    slots_in: tuple[int, ...] | None = None  # per-rank element counts this rank sends
    slots_out: tuple[int, ...] | None = None  # per-rank element counts this rank receives
    root: int | None = None
    reduce_op: str | None = None
    algorithm: str | None = None
    ranks: tuple[int, ...] | None = None  # split
    site: str = "<unknown>"

    @classmethod
    def of(
        cls,
        seq: int,
        op: str,
        tensor: torch.Tensor | None = None,
        *,
        slots_in: Sequence[torch.Tensor] | None = None,
        slots_out: Sequence[torch.Tensor] | None = None,
        root: int | None = None,
        reduce_op: str | None = None,
        algorithm: str | None = None,
        ranks: Sequence[int] | None = None,
    ) -> Fingerprint:
        """Describe a call from its canonical arguments (no tensor is kept)."""
        first = tensor
        if first is None:
            first = next(iter(slots_in or slots_out or ()), None)
        return cls(
            seq=seq,
            op=op,
            dtype=None if first is None else _dtype_name(first.dtype),
            shape=None if tensor is None else tuple(tensor.shape),
            count=None if tensor is None else tensor.numel(),
            slots_in=None if slots_in is None else tuple(t.numel() for t in slots_in),
            slots_out=None if slots_out is None else tuple(t.numel() for t in slots_out),
            root=root,
            reduce_op=reduce_op,
            algorithm=algorithm,
            ranks=None if ranks is None else tuple(ranks),
            site=call_site(),
        )

    def agreement(self) -> tuple:
        """What every rank must have in common; per-peer slot counts are matched by :func:`find_mismatch`."""
        shared_slots = self.slots_out if self.op == Collective.ALL_GATHER else None
        if self.op == Collective.REDUCE_SCATTER:
            shared_slots = self.slots_in
        count = self.count if self.op in _SAME_COUNT else None
        return (
            self.op,
            self.dtype,
            count,
            shared_slots,
            self.root,
            self.reduce_op,
            self.algorithm,
            self.ranks,
        )

    def describe(self) -> str:
        """``all_reduce(float32[1024], sum)`` — how the call reads in an error message."""
        args = []
        if self.dtype is not None:
            shape = self.shape if self.shape is not None else (sum(self.slots_in or self.slots_out or ()),)
            args.append(f"{self.dtype}[{', '.join(map(str, shape))}]")
        if self.root is not None:
            args.append(f"root={self.root}")
        if self.reduce_op is not None:
            args.append(self.reduce_op)
        if self.ranks is not None:
            args.append(f"ranks={list(self.ranks)}")
        if self.algorithm is not None:
            args.append(f"algo={self.algorithm}")
        return f"{self.op}({', '.join(args)})"

    def to_json(self) -> dict:
        values = ((name, getattr(self, name)) for name in self.__slots__)  # type: ignore[attr-defined]
        return {name: value for name, value in values if value is not None}

    @classmethod
    def from_json(cls, data: dict) -> Fingerprint:
        tuples = ("shape", "slots_in", "slots_out", "ranks")
        return cls(**{k: tuple(v) if k in tuples and v is not None else v for k, v in data.items()})


def rank_list(ranks: Sequence[int]) -> str:
    """``rank 1`` or ``ranks 0,2,3``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def find_mismatch(prints: Sequence[Fingerprint]) -> str | None:
    """None when the calls of all ranks (``prints[r]`` from rank r) can meet, else why they cannot."""
    groups: dict[tuple, list[int]] = {}
    for rank, fp in enumerate(prints):
        groups.setdefault(fp.agreement(), []).append(rank)
    seq = prints[0].seq
    if len(groups) > 1:
        ordered = sorted(groups.values(), key=lambda ranks: (len(ranks), ranks))
        parts = [f"{rank_list(r)} called {prints[r[0]].describe()} at {prints[r[0]].site}" for r in ordered]
        return f"{parts[0]} while " + " and ".join(parts[1:]) + f" (collective #{seq})"
    return _peer_mismatch(prints)


def _peer_mismatch(prints: Sequence[Fingerprint]) -> str | None:
    """Per-peer counts that must pair up: what rank i sends to rank j is what j expects from i."""
    op, seq = prints[0].op, prints[0].seq
    for i, sender in enumerate(prints):
        for j, receiver in enumerate(prints):
            if op == Collective.ALL_TO_ALL:
                sent, expected = sender.slots_in[j], receiver.slots_out[i]  # type: ignore[index]
            elif op == Collective.SCATTER and i == sender.root and j != i:
                sent, expected = sender.slots_in[j], receiver.count  # type: ignore[index]
            elif op == Collective.GATHER and j == receiver.root and i != j:
                sent, expected = sender.count, receiver.slots_out[i]  # type: ignore[index]
            else:
                continue
            if sent != expected:
                return (
                    f"in {op} (collective #{seq}) rank {i} sends {sent} elements to rank {j} "
                    f"(at {sender.site}) but rank {j} expects {expected} from rank {i} (at {receiver.site})"
                )
    return None
