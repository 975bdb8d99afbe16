"""The ``mpi`` backend: a Communicator over mpi4py, for jobs started by ``mpirun`` or ``srun --mpi=pmix``.

Tensors travel without copies: a CPU tensor's memory is handed to MPI through a NumPy view (the buffer
protocol), and list-form arguments whose tensors are adjacent views of one buffer (what ``chunk`` gives)
are sent as that one buffer with counts and displacements. Only what MPI cannot express is staged:
float16/bfloat16 reductions accumulate in a float32 copy (MPI has no half types; the result is rounded
once, as in the other backends), and lists of separate tensors go through one contiguous buffer.

Every operation is an MPI non-blocking call (``MPI_Ibcast``, ``MPI_Iallreduce``, ...) whose request is
polled against the communicator's timeout, so a peer that never arrives becomes a
:class:`CommTimeoutError` naming the rank and the operation instead of a hang. MPI cannot cancel a
collective, so after a timeout the communicator must not be used again; the job should end (under
mpirun an uncaught exception aborts every rank, see :mod:`meshwise.runtime.mpi_bootstrap`).
Progress happens while a rank polls: an ``async_op=True`` collective advances when ``wait`` or
``is_completed`` is called.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from meshwise.comm.api import (
    HALF_DTYPES,
    CollectiveMismatchError,
    CommError,
    Communicator,
    ReduceOp,
    Work,
    accumulator,
    overlap,
)
from meshwise.comm.buffers import adjacent_span, joined, same_memory, scatter_back
from meshwise.comm.mpi.work import MpiWork, translate_mpi_error
from meshwise.comm.numpy_view import numpy_view
from meshwise.comm.splits import first_mismatch
from meshwise.runtime.mpi_wait import import_mpi
from meshwise.runtime.timeouts import DEFAULT_TIMEOUT_S

#: dtypes NumPy (or MPI) cannot describe move as their bit patterns; they never reach an MPI reduction.
_MOVE_AS = {torch.bfloat16: torch.int16, torch.float16: torch.int16}


class MpiCommunicator(Communicator):
    """Communicator over an mpi4py intra-communicator.

    ``MpiCommunicator(comm)`` uses ``comm`` as given (e.g. one the script built with ``Split``) and leaves
    it to the caller; :meth:`from_process_group` and :meth:`split` create private communicators, whose
    traffic can never match the script's own MPI messages, and free them in :meth:`close`.
    """

    backend = "mpi"

    def __init__(self, comm: Any, *, timeout: float = DEFAULT_TIMEOUT_S, owns: bool = False) -> None:
        self._MPI = import_mpi()
        self.comm = comm
        self._owns = owns  # free the MPI communicator on close() (only ones this class created)
        super().__init__(comm.Get_rank(), comm.Get_size(), timeout)
        # The largest tag is reserved for split()'s handshake; user tags get the rest.
        self._tag_limit = int(comm.Get_attr(self._MPI.TAG_UB)) - 1
        self._ops = {
            ReduceOp.SUM: self._MPI.SUM,
            ReduceOp.AVG: self._MPI.SUM,  # then divided once by the world size
            ReduceOp.MAX: self._MPI.MAX,
            ReduceOp.MIN: self._MPI.MIN,
            ReduceOp.PROD: self._MPI.PROD,
        }

    @classmethod
    def from_process_group(cls, group: dist.ProcessGroup | None, *, timeout: float) -> MpiCommunicator:
        """A private duplicate of MPI_COMM_WORLD (restricted to ``group``'s ranks when one is given).

        torch.distributed stays the control plane; MPI must number the processes the same way, which it
        does when both were set up from the same mpirun/srun job (meshwise.init takes the ranks from MPI).
        """
        MPI = import_mpi()
        world = MPI.COMM_WORLD
        members = None
        if dist.is_available() and dist.is_initialized():
            torch_layout = (dist.get_rank(), dist.get_world_size())
            if torch_layout != (world.Get_rank(), world.Get_size()):
                raise CommError(
                    f"torch.distributed has this process as rank {torch_layout[0]} of {torch_layout[1]} but "
                    f"MPI as rank {world.Get_rank()} of {world.Get_size()}: backend 'mpi' needs a job "
                    "started by mpirun or srun --mpi=pmix (use gloo or shm under torchrun / meshwise run)",
                    rank=torch_layout[0],
                    op="init",
                )
            if group is not None and group is not dist.group.WORLD:
                members = dist.get_process_group_ranks(group)
        elif group is not None:
            raise ValueError("a process group was passed but torch.distributed is not initialised")
        duplicate, request = world.Idup()
        base = cls(duplicate, timeout=timeout, owns=True)
        MpiWork([request], base.rank, "init", timeout).wait()
        if members is None or members == list(range(base.world_size)):
            return base
        if base.rank not in members:
            base.close()
            raise ValueError(f"rank {base.rank} is not a member of the process group {members}")
        sub = base._split(members)
        base.close()
        assert sub is not None
        return sub

    # ------------------------------------------------------------------ plumbing
    def _array(self, tensor: torch.Tensor, op: str) -> Any:
        """A NumPy view of ``tensor``'s memory (no copy) that mpi4py passes to MPI as a typed buffer."""
        if tensor.device.type != "cpu":
            raise ValueError(
                f"[rank {self.rank} · {op}] backend 'mpi' moves CPU tensors but got one on {tensor.device}; "
                "use backend 'nccl' for GPU tensors (MPI can still bootstrap the job), or move it to the CPU"
            )
        flat = tensor.detach().reshape(-1)
        if flat.dtype in _MOVE_AS:
            flat = flat.view(_MOVE_AS[flat.dtype])
        return numpy_view(flat)

    def _start(
        self,
        op: str,
        launch: Callable[[], Any],
        finish: Callable[[], None] | None = None,
        keep: Sequence[object] = (),
        statuses: list[Any] | None = None,
    ) -> MpiWork:
        try:
            requests = launch()
        except self._MPI.Exception as exc:
            raise translate_mpi_error(exc, self.rank, op) from exc
        requests = requests if isinstance(requests, list) else [requests]
        return MpiWork(requests, self.rank, op, self.timeout, finish, keep, statuses)

    def _reduced(self, target: torch.Tensor, acc: torch.Tensor, op: ReduceOp) -> Callable[[], None]:
        """Finishing step of a reduction: AVG's single division, then rounding back into ``target``."""

        def finish() -> None:
            if op is ReduceOp.AVG:
                acc.div_(self.world_size)
            if acc is not target:
                target.view(-1).copy_(acc.reshape(-1))

        return finish

    def _check_tag(self, tag: int, op: str) -> None:
        if not 0 <= tag <= self._tag_limit:
            raise ValueError(
                f"[rank {self.rank} · {op}] tag {tag} is outside the MPI range 0..{self._tag_limit}"
            )

    # ------------------------------------------------------------------ point to point
    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        self._check_tag(tag, "send")
        buf = self._array(tensor, "send")
        return self._start("send", lambda: self.comm.Isend(buf, dst, tag), keep=(buf,))

    def _irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        self._check_tag(tag, "recv")
        buf = self._array(tensor, "recv")
        status = self._MPI.Status()

        def check_size() -> None:  # a shorter message is legal MPI, but here it means a size disagreement
            count = status.Get_count(self._MPI.BYTE)
            if count != buf.nbytes:
                raise CollectiveMismatchError(
                    f"received {count} bytes from rank {src} but the buffer holds {buf.nbytes}: the sender "
                    "and the receiver disagree on the size",
                    rank=self.rank,
                    op="recv",
                )

        return self._start("recv", lambda: self.comm.Irecv(buf, src, tag), check_size, (buf,), [status])

    # ------------------------------------------------------------------ collectives
    def _broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        buf = self._array(tensor, "broadcast")
        return self._start("broadcast", lambda: self.comm.Ibcast(buf, root), keep=(buf,))

    def _reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp) -> Work:
        acc = accumulator(tensor)
        buf = self._array(acc, "reduce")
        if self.rank != root:  # the send buffer is only read: this rank's tensor stays unchanged
            return self._start(
                "reduce", lambda: self.comm.Ireduce(buf, None, self._ops[op], root), keep=(buf,)
            )
        return self._start(
            "reduce",
            lambda: self.comm.Ireduce(self._MPI.IN_PLACE, buf, self._ops[op], root),
            self._reduced(tensor, acc, op),
            keep=(buf,),
        )

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        acc = accumulator(tensor)
        buf = self._array(acc, "all_reduce")
        return self._start(
            "all_reduce",
            lambda: self.comm.Iallreduce(self._MPI.IN_PLACE, buf, self._ops[op]),
            self._reduced(tensor, acc, op),
            keep=(buf,),
        )

    def _all_gather(self, outputs: list[torch.Tensor], input: torch.Tensor) -> Work:
        counts = [t.numel() for t in outputs]
        span = adjacent_span(outputs)
        recv = span if span is not None else torch.empty(sum(counts), dtype=input.dtype)
        recv_buf = self._array(recv, "all_gather")
        in_place = span is not None and same_memory(input, outputs[self.rank])
        send = self._MPI.IN_PLACE if in_place else self._array(input, "all_gather")
        if len(set(counts)) == 1:
            launch = partial(self.comm.Iallgather, send, recv_buf)
        else:
            launch = partial(self.comm.Iallgatherv, send, [recv_buf, counts])
        finish = None if span is not None else scatter_back(recv, outputs)
        return self._start("all_gather", launch, finish, keep=(send, recv_buf))

    def _reduce_scatter(self, output: torch.Tensor, inputs: list[torch.Tensor], op: ReduceOp) -> Work:
        counts = [t.numel() for t in inputs]
        if output.dtype in HALF_DTYPES:
            send = torch.cat([t.reshape(-1).float() for t in inputs])
        else:
            send = joined(inputs)
        recv = output
        if recv.dtype in HALF_DTYPES or overlap(recv, send):
            recv = torch.empty(output.numel(), dtype=send.dtype)
        send_buf = self._array(send, "reduce_scatter")
        recv_buf = self._array(recv, "reduce_scatter")
        mpi_op = self._ops[op]
        if len(set(counts)) == 1:
            launch = partial(self.comm.Ireduce_scatter_block, send_buf, recv_buf, mpi_op)
        else:
            launch = partial(self.comm.Ireduce_scatter, send_buf, recv_buf, counts, mpi_op)
        return self._start("reduce_scatter", launch, self._reduced(output, recv, op), (send_buf, recv_buf))

    def _all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Work:
        send_counts = [t.numel() for t in inputs]
        recv_counts = [t.numel() for t in outputs]
        self._check_pairs(send_counts, recv_counts)
        span = adjacent_span(outputs)
        recv = span if span is not None else torch.empty(sum(recv_counts), dtype=inputs[0].dtype)
        send = joined(inputs)
        if overlap(send, recv):
            send = send.clone()
        send_buf = self._array(send, "all_to_all")
        recv_buf = self._array(recv, "all_to_all")
        if len(set(send_counts + recv_counts)) == 1:
            launch = partial(self.comm.Ialltoall, send_buf, recv_buf)
        else:
            launch = partial(self.comm.Ialltoallv, [send_buf, send_counts], [recv_buf, recv_counts])
        finish = None if span is not None else scatter_back(recv, outputs)
        return self._start("all_to_all", launch, finish, keep=(send_buf, recv_buf))

    def _check_pairs(self, send_counts: list[int], recv_counts: list[int]) -> None:
        """Every rank's counts, gathered before any data moves: mismatched ``Alltoallv`` counts truncate
        (an MPI error) or leave output unwritten, so the pair that disagrees is named instead."""
        mine = torch.tensor(send_counts + recv_counts, dtype=torch.int64)
        table = torch.empty(self.world_size, mine.numel(), dtype=torch.int64)
        buffers = (self._array(mine, "all_to_all"), self._array(table, "all_to_all"))
        self._start("all_to_all", partial(self.comm.Iallgather, *buffers), keep=buffers).wait()
        n = self.world_size
        wrong = first_mismatch(table[:, :n].tolist(), table[:, n:].tolist(), "all_to_all")
        if wrong:
            raise CollectiveMismatchError(wrong, rank=self.rank, op="all_to_all")

    def _scatter(self, output: torch.Tensor, inputs: list[torch.Tensor] | None, root: int) -> Work:
        recv_buf = self._array(output, "scatter")
        if self.rank != root:
            return self._start("scatter", lambda: self.comm.Iscatterv(None, recv_buf, root), keep=(recv_buf,))
        assert inputs is not None
        counts = [t.numel() for t in inputs]
        send = joined(inputs)
        in_place = same_memory(output, inputs[root])  # root's own slot is already in place
        if overlap(send, output) and not in_place:
            send = send.clone()
        send_buf = self._array(send, "scatter")
        recv = self._MPI.IN_PLACE if in_place else recv_buf
        return self._start(
            "scatter", lambda: self.comm.Iscatterv([send_buf, counts], recv, root), keep=(send_buf, recv_buf)
        )

    def _gather(self, input: torch.Tensor, outputs: list[torch.Tensor] | None, root: int) -> Work:
        if self.rank != root:
            send_buf = self._array(input, "gather")
            return self._start("gather", lambda: self.comm.Igatherv(send_buf, None, root), keep=(send_buf,))
        assert outputs is not None
        counts = [t.numel() for t in outputs]
        span = adjacent_span(outputs)
        recv = span if span is not None else torch.empty(sum(counts), dtype=input.dtype)
        recv_buf = self._array(recv, "gather")
        in_place = span is not None and same_memory(input, outputs[root])
        send = self._MPI.IN_PLACE if in_place else self._array(input, "gather")
        finish = None if span is not None else scatter_back(recv, outputs)
        return self._start(
            "gather", lambda: self.comm.Igatherv(send, [recv_buf, counts], root), finish, (send, recv_buf)
        )

    def _barrier(self) -> Work:
        return self._start("barrier", self.comm.Ibarrier)

    def _split(self, ranks: list[int]) -> Communicator | None:
        if self.rank not in ranks:
            return None
        self._handshake(ranks)
        group = self.comm.Get_group()
        try:
            members = group.Incl(ranks)
            sub = self.comm.Create_group(members)
        except self._MPI.Exception as exc:
            raise translate_mpi_error(exc, self.rank, "split") from exc
        finally:
            group.Free()
        members.Free()
        return MpiCommunicator(sub, timeout=self.timeout, owns=True)

    def _handshake(self, ranks: list[int]) -> None:
        """Bounded meeting of the members before the blocking MPI_Comm_create_group.

        MPI has no non-blocking communicator creation, so the members first meet point to point under the
        timeout: the first member collects every member's ``ranks`` and answers whether they all agree.
        A member that never calls split becomes a timeout here instead of a hang inside MPI.
        """
        tag = self._tag_limit + 1
        mine = torch.tensor(ranks, dtype=torch.int64)
        leader = ranks[0]
        if self.rank == leader:
            seen = {r: torch.full((len(ranks),), -1, dtype=torch.int64) for r in ranks[1:]}
            works = [self._start("split", lambda r=r: self.comm.Irecv(seen[r].numpy(), r, tag)) for r in seen]
            for work in works:
                work.wait()
            agree = all(torch.equal(other, mine) for other in seen.values())
            verdict = torch.tensor([1 if agree else 0], dtype=torch.int64)
            replies = [
                self._start("split", lambda r=r: self.comm.Isend(verdict.numpy(), r, tag)) for r in seen
            ]
            for work in replies:
                work.wait()
        else:
            verdict = torch.zeros(1, dtype=torch.int64)
            sent = self._start("split", lambda: self.comm.Isend(mine.numpy(), leader, tag), keep=(mine,))
            answer = self._start("split", lambda: self.comm.Irecv(verdict.numpy(), leader, tag))
            sent.wait()
            answer.wait()
        if verdict.item() != 1:
            raise CollectiveMismatchError(
                f"members called split with different rank lists (this rank passed {ranks})",
                rank=self.rank,
                op="split",
            )

    def close(self) -> None:
        """Free the MPI communicator if this class created it (safe to call twice)."""
        if self._owns and self.comm != self._MPI.COMM_NULL and not self._MPI.Is_finalized():
            self.comm.Free()
        self._owns = False


__all__ = ["MpiCommunicator"]
