"""A Communicator that runs collectives with a chosen algorithm on top of another one's point-to-point.

``with_algorithm(base, "rhd")`` keeps ``base`` for transport (its isend/irecv), barrier and splitting,
and replaces the collectives the algorithm covers (see :mod:`meshwise.comm.algorithms.registry`) by plans run
through the executor; the others go to ``base``'s own implementation. ``auto`` asks the cost model for
the fastest choice per call — including ``native`` — from values every rank knows identically (the
message size for rooted and reducing collectives; only the world size for scatter, gather and
all_to_all, whose per-rank sizes may differ).

Reductions of float16/bfloat16 upcast the whole working vector to float32, run the algorithm on it
(so messages carry float32) and round once at the end; AVG reduces as SUM and divides once.
Algorithm collectives run to completion on the calling thread: ``async_op=True`` returns an already
completed handle.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from meshwise.comm.algorithms import rooted
from meshwise.comm.algorithms.choice import cached_choice
from meshwise.comm.algorithms.consistency import check_agreement
from meshwise.comm.algorithms.executor import execute
from meshwise.comm.algorithms.hierarchical import Hierarchy
from meshwise.comm.algorithms.plan import Plan
from meshwise.comm.algorithms.registry import build_plan, canonical_algorithm, covers
from meshwise.comm.api import (
    Communicator,
    CompletedWork,
    ReduceOp,
    Work,
    accumulator,
    accumulator_dtype,
)
from meshwise.comm.cost.calibration import Calibration

#: Ring segments: blocks larger than this are cut so that a segment is forwarded while the next arrives.
DEFAULT_SEGMENT_BYTES = 1 << 20


def _flat_slots(slots: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One flat view over ``slots`` when they are consecutive pieces of a single buffer, else None."""
    first = slots[0]
    if first.numel() == 0 and len(slots) > 1:
        return None
    size = first.element_size()
    total = sum(s.numel() for s in slots)
    expected = first.data_ptr()
    for s in slots:
        if s.data_ptr() != expected or s.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        expected += s.numel() * size
    offset = first.storage_offset()
    if offset + total > first.untyped_storage().nbytes() // size:
        return None
    return first.new_empty(0).set_(first.untyped_storage(), offset, (total,))


class AlgorithmCommunicator(Communicator):
    """Collectives by ``algo`` over ``base``'s point-to-point; uncovered ones by ``base`` itself."""

    def __init__(
        self,
        base: Communicator,
        algo: str,
        *,
        node_map: Sequence[int] | None = None,
        calibration: Calibration | None = None,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        check_consistency: bool = False,
        hierarchy: Hierarchy | None = None,
    ) -> None:
        """``hierarchy`` hands in ready-made node and cross-node communicators (another transport per
        level, :mod:`meshwise.comm.two_level`); otherwise a ``node_map`` splits them off ``base``."""
        algo = canonical_algorithm(algo)
        if hierarchy is not None:
            node_map = hierarchy.topology.node_of
        if segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be positive, got {segment_bytes}")
        if algo == "hierarchical" and node_map is None:
            raise ValueError("algo='hierarchical' needs node_map= (the node id of every rank)")
        super().__init__(base.rank, base.world_size, base.timeout)
        self.base = base
        self.algo = algo
        self.backend = base.backend
        self.calibration = calibration if calibration is not None else Calibration.builtin()
        self.segment_bytes = segment_bytes
        self.check_consistency = check_consistency
        self.node_map = list(node_map) if node_map is not None else None
        self.hierarchy: Hierarchy | None = hierarchy
        self._owned: list[Communicator] = []  # communicators this wrapper split off and must close
        if hierarchy is None and node_map is not None and algo in ("hierarchical", "auto"):
            inter = self.calibration.inter
            inter_cal = Calibration(inter, inter, inter, source=self.calibration.source)

            def wrap(sub: Communicator, sub_algo: str) -> Communicator:
                cal = inter_cal if sub_algo == "auto" else self.calibration
                return AlgorithmCommunicator(sub, sub_algo, calibration=cal, segment_bytes=segment_bytes)

            self.hierarchy = Hierarchy.split(base, node_map, wrap)

    def __repr__(self) -> str:
        return f"AlgorithmCommunicator(algo={self.algo!r}, base={self.base!r})"

    def close(self) -> None:
        """Close what this wrapper created (node and cross-node groups, a split's base); ``base`` itself
        stays open: it belongs to the caller."""
        if self.hierarchy is not None:
            self.hierarchy.close()
        for sub in self._owned:
            sub.close()

    # ------------------------------------------------------------------ choice
    def choose(self, collective: str, nbytes: int) -> str:
        """The algorithm that runs ``collective`` on ``nbytes`` (what ``auto`` picks, or the fallback)."""
        if self.algo == "auto":
            local = self.hierarchy.local_size if self.hierarchy is not None else None
            return cached_choice(collective, nbytes, self.world_size, self.calibration, local_size=local)
        return self.algo if covers(self.algo, collective) else "native"

    def _agree(self, collective: str, dtype: torch.dtype, size: int = -1, root: int = -1) -> None:
        if self.check_consistency:
            check_agreement(self.base, collective, dtype, size, root)

    def _pieces(self, block_bytes: int) -> int:
        return max(1, -(-block_bytes // self.segment_bytes))

    def _run(self, plan: Plan, buffers: dict[str, torch.Tensor], op: ReduceOp = ReduceOp.SUM) -> None:
        execute(plan, self.base, buffers, op)

    # ------------------------------------------------------------------ point to point, control
    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        return self.base._isend(tensor, dst, tag)

    def _irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        return self.base._irecv(tensor, src, tag)

    def _barrier(self) -> Work:
        return self.base._barrier()

    def _split(self, ranks: list[int]) -> Communicator | None:
        sub = self.base.split(ranks)
        if sub is None:
            return None
        node_map = [self.node_map[r] for r in ranks] if self.node_map is not None else None
        algo = self.algo
        if algo == "hierarchical" and node_map is not None and len(set(node_map)) == 1:
            algo = "auto"  # a single node has no hierarchy left
        wrapper = AlgorithmCommunicator(
            sub,
            algo,
            node_map=node_map,
            calibration=self.calibration,
            segment_bytes=self.segment_bytes,
            check_consistency=self.check_consistency,
        )
        wrapper._owned.append(sub)
        return wrapper

    # ------------------------------------------------------------------ reductions
    def _all_reduce_into(self, source: torch.Tensor, output: torch.Tensor, op: ReduceOp) -> Work:
        if self.choose("all_reduce", source.numel() * source.element_size()) == "native":
            self._agree("all_reduce", source.dtype, source.numel())
            return self.base._all_reduce_into(source, output, op)  # the base may skip the copy
        return super()._all_reduce_into(source, output, op)

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        self._agree("all_reduce", tensor.dtype, tensor.numel())
        algo = self.choose("all_reduce", tensor.numel() * tensor.element_size())
        if algo == "native" or self.world_size == 1:
            return self.base._all_reduce(tensor, op)
        data = accumulator(tensor).view(-1)
        if algo == "hierarchical":
            assert self.hierarchy is not None
            pieces = self._pieces(data.numel() * data.element_size() // self.hierarchy.local_size)
            self.hierarchy.all_reduce(data, ReduceOp.SUM if op is ReduceOp.AVG else op, pieces)
        else:
            block = data.numel() * data.element_size() // self.world_size
            plan = build_plan(
                "all_reduce", algo, self.rank, self.world_size, (data.numel(),), pieces=self._pieces(block)
            )
            self._run(plan, {"data": data}, op)
        if op is ReduceOp.AVG:
            data.div_(self.world_size)
        if data.data_ptr() != tensor.data_ptr() or data.dtype != tensor.dtype:
            tensor.view(-1).copy_(data)
        return CompletedWork()

    def _reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp) -> Work:
        self._agree("reduce", tensor.dtype, tensor.numel(), root)
        algo = self.choose("reduce", tensor.numel() * tensor.element_size())
        if algo == "native" or self.world_size == 1:
            return self.base._reduce(tensor, root, op)
        data = accumulator(tensor).reshape(-1)
        if self.rank != root and data.data_ptr() == tensor.data_ptr():
            data = data.clone()  # non-root inputs stay unchanged
        self._run(
            build_plan("reduce", algo, self.rank, self.world_size, (data.numel(),), root), {"data": data}, op
        )
        if self.rank == root:
            if op is ReduceOp.AVG:
                data.div_(self.world_size)
            if data.data_ptr() != tensor.data_ptr() or data.dtype != tensor.dtype:
                tensor.view(-1).copy_(data)
        return CompletedWork()

    def _reduce_scatter(self, output: torch.Tensor, inputs: list[torch.Tensor], op: ReduceOp) -> Work:
        counts = tuple(t.numel() for t in inputs)
        self._agree("reduce_scatter", output.dtype, sum(counts))
        algo = self.choose("reduce_scatter", sum(counts) * output.element_size())
        if algo == "native" or self.world_size == 1:
            return self.base._reduce_scatter(output, inputs, op)
        dtype = accumulator_dtype(output.dtype)
        data = torch.cat([t.reshape(-1) for t in inputs]).to(dtype)
        block = max(counts) * data.element_size()
        plan = build_plan(
            "reduce_scatter", algo, self.rank, self.world_size, counts, pieces=self._pieces(block)
        )
        self._run(plan, {"data": data}, op)
        start = sum(counts[: self.rank])
        mine = data[start : start + counts[self.rank]]
        if op is ReduceOp.AVG:
            mine.div_(self.world_size)
        output.view(-1).copy_(mine)
        return CompletedWork()

    # ------------------------------------------------------------------ data movement
    def _broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        self._agree("broadcast", tensor.dtype, tensor.numel(), root)
        algo = self.choose("broadcast", tensor.numel() * tensor.element_size())
        if algo == "native" or self.world_size == 1:
            return self.base._broadcast(tensor, root)
        if algo == "hierarchical":
            assert self.hierarchy is not None
            self.hierarchy.broadcast(tensor.view(-1), root)
            return CompletedWork()
        plan = build_plan("broadcast", algo, self.rank, self.world_size, (tensor.numel(),), root)
        self._run(plan, {"data": tensor.view(-1)})
        return CompletedWork()

    def _all_gather(self, outputs: list[torch.Tensor], input: torch.Tensor) -> Work:
        counts = tuple(t.numel() for t in outputs)
        self._agree("all_gather", input.dtype, sum(counts))
        algo = self.choose("all_gather", sum(counts) * input.element_size())
        if algo == "native" or self.world_size == 1:
            return self.base._all_gather(outputs, input)
        if algo == "hierarchical":
            assert self.hierarchy is not None
            self.hierarchy.all_gather(outputs, input)
            return CompletedWork()
        flat = _flat_slots(outputs)
        data = flat if flat is not None else torch.empty(sum(counts), dtype=input.dtype, device=input.device)
        start = sum(counts[: self.rank])
        mine = data[start : start + counts[self.rank]]
        if mine.data_ptr() != input.data_ptr():
            mine.copy_(input.reshape(-1))
        plan = build_plan(
            "all_gather",
            algo,
            self.rank,
            self.world_size,
            counts,
            pieces=self._pieces(max(counts) * data.element_size()),
        )
        self._run(plan, {"data": data})
        if flat is None:
            for out, piece in zip(outputs, data.split(list(counts)), strict=True):
                out.view(-1).copy_(piece)
        return CompletedWork()

    def _all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Work:
        self._agree("all_to_all", inputs[0].dtype)
        algo = self.choose("all_to_all", 0)
        if algo == "native" or self.world_size == 1:
            return self.base._all_to_all(outputs, inputs)
        sizes = tuple(t.numel() for t in inputs) + tuple(t.numel() for t in outputs)
        flat_out = _flat_slots(outputs)
        out = (
            flat_out
            if flat_out is not None
            else torch.empty(sum(sizes[self.world_size :]), dtype=inputs[0].dtype, device=inputs[0].device)
        )
        self._run(
            build_plan("all_to_all", algo, self.rank, self.world_size, sizes),
            {"in": torch.cat([t.reshape(-1) for t in inputs]), "out": out},
        )
        if flat_out is None:
            for target, piece in zip(outputs, out.split(list(sizes[self.world_size :])), strict=True):
                target.view(-1).copy_(piece)
        return CompletedWork()

    def _scatter(self, output: torch.Tensor, inputs: list[torch.Tensor] | None, root: int) -> Work:
        self._agree("scatter", output.dtype, root=root)
        algo = self.choose("scatter", 0)
        if algo == "native" or self.world_size == 1:
            return self.base._scatter(output, inputs, root)
        rooted.scatter(self._run, self.rank, self.world_size, algo, output, inputs, root)
        return CompletedWork()

    def _gather(self, input: torch.Tensor, outputs: list[torch.Tensor] | None, root: int) -> Work:
        self._agree("gather", input.dtype, root=root)
        algo = self.choose("gather", 0)
        if algo == "native" or self.world_size == 1:
            return self.base._gather(input, outputs, root)
        rooted.gather(self._run, self.rank, self.world_size, algo, input, outputs, root)
        return CompletedWork()


def with_algorithm(
    base: Communicator,
    algo: str,
    *,
    node_map: Sequence[int] | None = None,
    calibration: Calibration | None = None,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    check_consistency: bool = False,
) -> Communicator:
    """``base`` with its collectives run by ``algo`` (a name in the registry's ``ALGORITHMS`` or an alias;
    ``native`` = ``base`` itself, or a thin wrapper that only adds the consistency check when
    ``check_consistency`` is set).

    Every rank must call it with the same arguments (``hierarchical`` and ``auto`` with a node map split
    the group into node and cross-node sub-communicators, a collective operation). ``segment_bytes`` is
    the ring pipelining unit; ``check_consistency`` verifies before every collective that all ranks
    agree on it, its dtype, size and root (one extra small all_reduce: a debugging aid, like
    TORCH_DISTRIBUTED_DEBUG=DETAIL). ``calibration`` prices ``auto``'s choices; the default is
    :meth:`Calibration.builtin` (no file is read unless the caller loads one).
    """
    algo = canonical_algorithm(algo)
    if algo == "native" and not check_consistency:
        return base
    return AlgorithmCommunicator(
        base,
        algo,
        node_map=node_map,
        calibration=calibration,
        segment_bytes=segment_bytes,
        check_consistency=check_consistency,
    )
