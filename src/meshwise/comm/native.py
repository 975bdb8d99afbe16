"""The ``native`` backend: a Communicator over a torch.distributed process group (gloo, nccl, mpi).

torch.distributed is our engine across machines; this adapter gives it the Communicator contract:
errors that name the rank and the operation, finite timeouts on every wait, half-precision reductions
accumulated in float32, and uneven gather/all_gather/scatter (which gloo refuses) through padding.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable

import torch
import torch.distributed as dist

from meshwise.comm.api import (
    AllWork,
    ChainedWork,
    CollectiveMismatchError,
    CommError,
    CommTimeoutError,
    Communicator,
    CompletedWork,
    PeerFailureError,
    ReduceOp,
    Work,
    accumulator,
    overlap,
)
from meshwise.comm.buffers import adjacent_span, joined, scatter_back
from meshwise.comm.splits import first_mismatch
from meshwise.runtime.timeouts import DEFAULT_TIMEOUT_S

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.PROD: dist.ReduceOp.PRODUCT,
}

_PEER_GONE_MARKERS = ("connection closed", "connection reset", "broken pipe", "end of file", "peer")


def translate_error(exc: Exception, rank: int, op: str, timeout: float) -> CommError:
    """Turn a torch.distributed failure into the CommError subclass that explains it."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    lower = text.lower()
    if "timed out" in lower or "timeout" in lower:
        return CommTimeoutError(
            f"no progress within {timeout:g} s ({text}); a peer may have hung, died or called another "
            "operation",
            rank=rank,
            op=op,
        )
    if any(marker in lower for marker in _PEER_GONE_MARKERS):
        return PeerFailureError(f"a peer process went away: {text}", rank=rank, op=op)
    return CommError(text, rank=rank, op=op)


class NativeWork(Work):
    """A torch.distributed work handle whose wait is bounded and whose errors are translated."""

    def __init__(self, work: dist.Work | None, rank: int, op: str, timeout: float) -> None:
        self._work = work
        self._rank = rank
        self._op = op
        self._timeout = timeout

    def wait(self, timeout: float | None = None) -> None:
        if self._work is None:
            return
        limit = self._timeout if timeout is None else timeout
        try:
            self._work.wait(datetime.timedelta(seconds=limit))
        except Exception as exc:  # torch raises RuntimeError/DistBackendError with backend-specific text
            raise translate_error(exc, self._rank, self._op, limit) from exc
        self._work = None

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


class NativeCommunicator(Communicator):
    """Communicator over a torch.distributed group (``None`` = the default world group)."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call meshwise.init() first")
        self.group: dist.ProcessGroup | None = group if group is not None else dist.group.WORLD
        super().__init__(dist.get_rank(self.group), dist.get_world_size(self.group), timeout)
        self.backend = str(dist.get_backend(self.group))

    @classmethod
    def from_process_group(cls, group: dist.ProcessGroup | None, *, timeout: float) -> NativeCommunicator:
        return cls(group, timeout=timeout)

    # ------------------------------------------------------------------ plumbing
    def _global(self, group_rank: int) -> int:
        return (
            dist.get_global_rank(self.group, group_rank) if self.group is not dist.group.WORLD else group_rank
        )

    def _start(self, op: str, launch: Callable[[], dist.Work | None]) -> NativeWork:
        if self.group is None:
            raise CommError("the communicator is closed", rank=self.rank, op=op)
        try:
            return NativeWork(launch(), self.rank, op, self.timeout)
        except Exception as exc:
            raise translate_error(exc, self.rank, op, self.timeout) from exc

    @staticmethod
    def _copy_back(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None]:
        def finish() -> None:
            for target, source in pairs:
                if target is not source:
                    target.copy_(source)

        return finish

    def close(self) -> None:
        """Drop the process group. A ProcessGroupGloo that Python still references after
        ``destroy_process_group`` is torn down at interpreter exit instead, where it aborts the process
        ("terminate called without an active exception") in about one run in six."""
        self.group = None

    # ------------------------------------------------------------------ point to point
    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        return self._start("send", lambda: dist.isend(tensor, self._global(dst), group=self.group, tag=tag))

    def _irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        return self._start("recv", lambda: dist.irecv(tensor, self._global(src), group=self.group, tag=tag))

    # ------------------------------------------------------------------ collectives
    def _broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        return self._start(
            "broadcast", lambda: dist.broadcast(tensor, self._global(root), group=self.group, async_op=True)
        )

    def _reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp) -> Work:
        # torch's reduce may overwrite non-root inputs with partial results; the contract leaves them
        # unchanged, so non-roots reduce a scratch copy.
        work_tensor = accumulator(tensor) if self.rank == root else accumulator(tensor).clone()
        work = self._start(
            "reduce",
            lambda: dist.reduce(
                work_tensor, self._global(root), op=_TORCH_OPS[op], group=self.group, async_op=True
            ),
        )
        if self.rank != root:
            return work
        return ChainedWork(work, self._copy_back([(tensor, work_tensor)]))

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        work_tensor = accumulator(tensor)
        work = self._start(
            "all_reduce",
            lambda: dist.all_reduce(work_tensor, op=_TORCH_OPS[op], group=self.group, async_op=True),
        )
        return ChainedWork(work, self._copy_back([(tensor, work_tensor)]))

    def _reduce_scatter(self, output: torch.Tensor, inputs: list[torch.Tensor], op: ReduceOp) -> Work:
        sizes = [t.numel() for t in inputs]
        work_output = accumulator(output)
        if len(set(sizes)) == 1:
            work_inputs = [accumulator(t).reshape(-1) for t in inputs]
            flat_out = work_output.view(-1)
            work = self._start(
                "reduce_scatter",
                lambda: dist.reduce_scatter(
                    flat_out, work_inputs, op=_TORCH_OPS[op], group=self.group, async_op=True
                ),
            )
            return ChainedWork(work, self._copy_back([(output, work_output)]))
        # Uneven slots: reduce the whole concatenation, keep this rank's slice (gloo has no v-variant).
        whole = torch.cat([accumulator(t).reshape(-1) for t in inputs])
        work = self._start(
            "reduce_scatter",
            lambda: dist.all_reduce(whole, op=_TORCH_OPS[op], group=self.group, async_op=True),
        )
        start = sum(sizes[: self.rank])

        def finish() -> None:
            output.view(-1).copy_(whole[start : start + sizes[self.rank]])

        return ChainedWork(work, finish)

    def _all_gather(self, outputs: list[torch.Tensor], input: torch.Tensor) -> Work:
        sizes = [t.numel() for t in outputs]
        if len(set(sizes)) == 1:
            flat_outputs = [t.view(-1) for t in outputs]
            source = input.reshape(-1)
            if source.data_ptr() == flat_outputs[self.rank].data_ptr():
                source = source.clone()  # in place: gloo must not read a slot it is writing
            return self._start(
                "all_gather",
                lambda: dist.all_gather(flat_outputs, source, group=self.group, async_op=True),
            )
        longest = max(sizes)
        padded = [torch.empty(longest, dtype=input.dtype, device=input.device) for _ in outputs]
        source = torch.zeros(longest, dtype=input.dtype, device=input.device)
        source[: input.numel()] = input.reshape(-1)
        work = self._start(
            "all_gather", lambda: dist.all_gather(padded, source, group=self.group, async_op=True)
        )

        def finish() -> None:
            for out, buf, size in zip(outputs, padded, sizes, strict=True):
                out.view(-1).copy_(buf[:size])

        return ChainedWork(work, finish)

    def _all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Work:
        send_counts = [t.numel() for t in inputs]
        recv_counts = [t.numel() for t in outputs]
        self._check_pairs(send_counts, recv_counts, inputs[0].device)
        span = adjacent_span(outputs)  # the slots of one tensor (all_to_all_single): received in place
        flat_out = span if span is not None else inputs[0].new_empty(sum(recv_counts))
        flat_in = joined(inputs)
        if overlap(flat_in, flat_out):
            flat_in = flat_in.clone()
        work = self._start(
            "all_to_all",
            lambda: dist.all_to_all_single(
                flat_out,
                flat_in,
                output_split_sizes=recv_counts,
                input_split_sizes=send_counts,
                group=self.group,
                async_op=True,
            ),
        )
        return work if span is not None else ChainedWork(work, scatter_back(flat_out, outputs))

    def _check_pairs(self, send_counts: list[int], recv_counts: list[int], device: torch.device) -> None:
        """Every rank's counts, gathered before any data moves: gloo aborts the whole process on split
        sizes that do not pair up (and NCCL would hang), so the pair that disagrees is named instead."""
        mine = torch.tensor(send_counts + recv_counts, dtype=torch.int64, device=device)
        table = [torch.empty_like(mine) for _ in range(self.world_size)]
        gather = lambda: dist.all_gather(table, mine, group=self.group, async_op=True)  # noqa: E731
        self._start("all_to_all", gather).wait()
        rows, n = [t.tolist() for t in table], self.world_size
        wrong = first_mismatch([r[:n] for r in rows], [r[n:] for r in rows], "all_to_all")
        if wrong:
            raise CollectiveMismatchError(wrong, rank=self.rank, op="all_to_all")

    def _scatter(self, output: torch.Tensor, inputs: list[torch.Tensor] | None, root: int) -> Work:
        # Sizes may differ per rank and non-roots do not know the others', so each slot travels by
        # point-to-point from the root: one message per rank, as in a linear scatter.
        if self.rank != root:
            return self._irecv(output, root, tag=0)
        assert inputs is not None
        works = [self._isend(inputs[r].contiguous(), r, tag=0) for r in range(self.world_size) if r != root]
        output.copy_(inputs[root].view_as(output))
        return AllWork(works)

    def _gather(self, input: torch.Tensor, outputs: list[torch.Tensor] | None, root: int) -> Work:
        if self.rank != root:
            return self._isend(input, root, tag=0)
        assert outputs is not None
        works = [self._irecv(outputs[r], r, tag=0) for r in range(self.world_size) if r != root]
        outputs[root].view(-1).copy_(input.reshape(-1))
        return AllWork(works)

    def _barrier(self) -> Work:
        return self._start("barrier", lambda: dist.barrier(group=self.group, async_op=True))

    def _split(self, ranks: list[int]) -> Communicator | None:
        if self.group is None:
            raise CommError("the communicator is closed", rank=self.rank, op="split")
        global_ranks = [self._global(r) for r in ranks]
        if len(ranks) > 1:  # a group of one is made by its member alone (Mesh does so): nothing to agree
            self._agree_on_split(global_ranks)
        try:
            group = dist.new_group(
                global_ranks,
                timeout=datetime.timedelta(seconds=self.timeout),
                use_local_synchronization=True,
            )
        except Exception as exc:
            raise translate_error(exc, self.rank, "split", self.timeout) from exc
        if self.rank not in ranks:
            return None
        return NativeCommunicator(group, timeout=self.timeout)

    def _agree_on_split(self, global_ranks: list[int]) -> None:
        """Return once every rank of this group asked for the same split as its same-numbered split;
        raise on every rank otherwise, naming the ranks, within the timeout.

        ``new_group`` must be called by every rank of the parent, in the same order, even with local
        synchronisation: torch names a new group by its ranks *and how many groups this process has
        made*, so a split that some ranks skip (or make with other members) lets its members go on with
        the group while the others' next group waits for a name nobody writes — a hang, not an error.
        Each rank posts its split's members under the split's number to the job's store and reads the
        others' (three store round trips; splits are rare)."""
        if self.world_size == 1:
            return
        assert self.group is not None
        from meshwise.comm.debug import default_store  # the job's store: private torch API, one place

        name = self.group.group_name
        seq = _SPLITS.get(name, 0)
        _SPLITS[name] = seq + 1
        store = default_store()
        keys = [f"meshwise/split/{name}/{seq}/{r}" for r in range(self.world_size)]
        store.set(keys[self.rank], json.dumps(global_ranks))
        op = f"split #{seq}"
        try:
            store.wait(keys, datetime.timedelta(seconds=self.timeout))
        except Exception:  # the store raises a plain RuntimeError/DistStoreError on timeout
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            raise CommTimeoutError(
                f"ranks {missing} did not call split within {self.timeout:g} s while this rank asked for "
                f"{global_ranks}: every rank of the group must call split, with the same ranks, in the "
                "same order (ranks outside the new group too: they get None)",
                rank=self.rank,
                op=op,
            ) from None
        asked = [json.loads(store.get(key)) for key in keys]
        if any(members != global_ranks for members in asked):
            what = "; ".join(f"rank {r} asked for {members}" for r, members in enumerate(asked))
            raise CollectiveMismatchError(
                f"the ranks asked for different splits ({what}): every rank of the group must call split "
                "with the same ranks, in the same order",
                rank=self.rank,
                op=op,
            )


#: splits made so far per parent process group (by torch's group name): the number every rank of that
#: group gives its next split, so ranks that diverge are caught at the first split where they differ
_SPLITS: dict[str, int] = {}

__all__ = ["CompletedWork", "NativeCommunicator", "NativeWork", "translate_error"]
