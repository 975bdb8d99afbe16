"""Data parallelism of pipeline stages: each chunk's gradients averaged by DataParallel's bucketed reducer
(docs/pipeline.md, Executor).

The executor only schedules; this tells each chunk's :class:`~meshwise.parallel.data_parallel.reducer.
GradReducer` which instruction computes its parameters' last gradients of the step — the chunk's last
backward or, under a split backward, its last B (parameters outside Linears) and last W (Linear
weights) — so buckets launch from autograd's hooks while that backward still runs, every earlier
micro-batch only accumulating. The averages are awaited once the rank's compute is over: no reduction
sits between a backward and the send of its input gradient (the critical path). Under ``ep`` a chunk
has two reducers, split by :func:`~meshwise.parallel.expert_parallel.replica_groups`. Every replica runs
the same program, so buckets launch in the same order on each; a failing rank launches what it has not
(:meth:`StageReducers.abort`) before the executor's failure all-reduce, so every collective meets its match.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from meshwise.comm.api import Communicator
from meshwise.parallel.data_parallel.buckets import MIB, plan_buckets
from meshwise.parallel.data_parallel.reducer import GradReducer
from meshwise.parallel.expert_parallel import ExpertReplicas, replica_groups
from meshwise.parallel.pipeline_parallel.schedules import Instruction, Op

#: Bucket cap (MiB) for a stage's reducer, below DataParallel's 25: a stage holds 1/pp of the model and
#: its synchronised backward is one micro-batch's, so at 25 MiB a small stage's gradients would sit in one
#: or two buckets, the big one launched when that backward ends — nothing left to overlap. At 4 MiB
#: gpt-nano's first stage (22 MB) has six, all but the last launched while the backward still runs.
STAGE_BUCKET_MB = 4.0


class StageReducers:
    """The reducers of a rank's ``chunks`` (chunk id → module) over ``comm`` (the stage's replicas), the
    expert parameters apart over ``experts`` when given."""

    def __init__(
        self,
        chunks: Mapping[int, nn.Module],
        comm: Communicator,
        program: Sequence[Instruction],
        *,
        experts: ExpertReplicas | None = None,
    ) -> None:
        self._reducers: dict[int, list[GradReducer]] = {}
        caps = round(STAGE_BUCKET_MB * MIB), MIB  # the first bucket: 1 MiB, as DataParallel's
        for c, chunk in chunks.items():
            named = [(n, p) for n, p in chunk.named_parameters() if p.requires_grad]
            reducers = [
                GradReducer(
                    params, group, plan_buckets([p for _, p in params], *caps),
                    find_unused_parameters=False, wire_dtype=None, end_with_backward=False,
                )
                for params, group in replica_groups(named, comm, experts)
                if group.world_size > 1
            ]  # fmt: skip
            if reducers:
                self._reducers[c] = reducers
        gradients = [(i.op, i.chunk, i.micro_batch) for i in program if i.op in (Op.BACKWARD, Op.WEIGHT)]
        last = {key[1]: key for key in gradients}  # chunk → its last gradient instruction
        self._synchronised = set({key[:2]: key for key in gradients}.values())  # each op's last, per chunk
        self._done = {key: c for c, key in last.items()}  # after it, chunk c has no gradient to come
        #: the order the chunks' reducers finish in: every replica flushes (and, failing, aborts) in it
        self._order = sorted(self._reducers, key=lambda c: gradients.index(last[c]))

    def before(self, ins: Instruction) -> None:
        """Before a backward / weight-gradient instruction: reduce from its hooks only if it is the last."""
        synchronised = (ins.op, ins.chunk, ins.micro_batch) in self._synchronised
        for reducer in self._reducers.get(ins.chunk, ()):
            reducer.sync = synchronised

    def after(self, ins: Instruction) -> None:
        """After one: once a chunk's gradients are all in, launch its buckets that are left — over a
        transport whose collectives run in the background; on one that completes them on the calling
        thread (shm) that would put the whole reduction before this rank's next send: :meth:`wait` does."""
        c = self._done.get((ins.op, ins.chunk, ins.micro_batch))
        for reducer in self._reducers.get(c, ()) if c is not None else ():
            if reducer.comm.overlaps_compute:
                reducer.flush()

    def wait(self) -> None:
        """Every chunk's averaged gradients in ``.grad`` (launching first whatever is left)."""
        for reducer in self._in_order():
            reducer.flush()
        for reducer in self._in_order():
            reducer.wait()

    def abort(self) -> None:
        """After a failure: launch and wait for what is left, so every replica ran the same collectives."""
        for reducer in self._in_order():
            reducer.sync = True
            try:
                reducer.flush()
                reducer.wait()
            except Exception:  # the step fails anyway; the collectives are what matter
                pass

    def _in_order(self) -> list[GradReducer]:
        return [reducer for c in self._order for reducer in self._reducers[c]]
