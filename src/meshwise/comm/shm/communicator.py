"""``ShmCommunicator``: the Communicator for ranks on one host, over shared memory.

torch.distributed (gloo) is only the control plane here: it agrees on a job token and a segment size,
exchanges process identities, and carries the barriers of the bootstrap. Every collective afterwards
moves data through the mapped segments with no socket, pipe or semaphore involved.

Collectives complete before the call returns (there is no background engine to overlap with on a CPU
that is itself doing the copies), so ``async_op=True`` hands back a completed :class:`Work`;
point-to-point operations are truly asynchronous and progress whenever this communicator waits.
"""

from __future__ import annotations

import datetime
import os
import secrets
import socket
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from meshwise.comm.api import CommError, Communicator, CompletedWork, ReduceOp, Work, overlap
from meshwise.comm.shm import collectives
from meshwise.comm.shm.p2p import P2PEngine
from meshwise.comm.shm.phase import PhaseEngine, ThreadLimit
from meshwise.comm.shm.segment import (
    DEFAULT_SEGMENT_BYTES,
    Layout,
    Segment,
    check_memory_model,
    free_bytes,
    plan_layout,
    segment_path,
    unlink_quietly,
)
from meshwise.comm.shm.sync import ABORT_CLOSED, Waiter, process_identity
from meshwise.runtime.cores import threads_per_rank
from meshwise.runtime.timeouts import DEFAULT_TIMEOUT_S

_COMPLETED = CompletedWork()


class ShmCommunicator(Communicator):
    """Shared-memory Communicator over the ranks of a torch.distributed group that share one host."""

    backend = "shm"
    overlaps_compute = False  # every collective completes on the calling thread (module docstring)

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        shm_dir: str = "/dev/shm",
        free_space: Callable[[str], int] = free_bytes,
        order: Sequence[int] | None = None,
    ) -> None:
        """``order`` lists the group's global ranks in this communicator's rank order (torch sorts the
        ranks of a new group; :meth:`split` keeps the order the caller asked for)."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call meshwise.init() first")
        check_memory_model()
        self.group: dist.ProcessGroup | None = group if group is not None else dist.group.WORLD
        size = dist.get_world_size(self.group)
        self._globals = list(order) if order is not None else [self._global_of(r) for r in range(size)]
        me = self._globals.index(dist.get_rank())
        super().__init__(me, size, timeout)
        self.shm_dir = shm_dir
        self._free_space = free_space
        self._segments: list[Segment] = []
        self._closed = False
        self.layout = self._bootstrap(segment_bytes)
        self.segment_bytes = segment_bytes

    @classmethod
    def from_process_group(
        cls,
        group: dist.ProcessGroup | None,
        *,
        timeout: float,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        shm_dir: str = "/dev/shm",
        free_space: Callable[[str], int] = free_bytes,
    ) -> ShmCommunicator:
        """Map one segment per rank of ``group``; ``segment_bytes`` bounds each rank's data buffers."""
        return cls(
            group, timeout=timeout, segment_bytes=segment_bytes, shm_dir=shm_dir, free_space=free_space
        )

    # ------------------------------------------------------------------ life cycle
    def _global_of(self, group_rank: int) -> int:
        return group_rank if self.group is dist.group.WORLD else dist.get_global_rank(self.group, group_rank)

    def _gather_objects(self, value: object) -> list:
        """all_gather_object over the group, returned in this communicator's rank order."""
        out: list = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        by_global = {self._global_of(r): v for r, v in enumerate(out)}
        return [by_global[g] for g in self._globals]

    def _agree(self, local: tuple[str, object], what: str) -> list:
        """all_gather ``(error or "", value)``; if any rank failed, every rank raises that error."""
        results = self._gather_objects(local)
        for peer, (error, _) in enumerate(results):
            if error:
                if peer == self.rank:
                    raise CommError(error, rank=self.rank, op="shm init")
                raise CommError(f"rank {peer} could not {what}: {error}", rank=self.rank, op="shm init")
        return [value for _, value in results]

    def _bootstrap(self, segment_bytes: int) -> Layout:
        # 1. rank 0 draws the job token and sizes the segments against the free space in /dev/shm.
        plan: tuple[str, object] = ("", None)
        if self.rank == 0:
            try:
                layout, warning = plan_layout(self.world_size, segment_bytes, self._free_space(self.shm_dir))
                plan = ("", (secrets.token_hex(8), layout, warning))
            except (CommError, ValueError, OSError) as exc:
                plan = (str(exc), None)
        token, layout, warning = self._agree(plan, "size the shared-memory segments")[0]
        self.token = token
        if warning and self.rank == 0:
            warnings.warn(warning, RuntimeWarning, stacklevel=4)
        # 2. every rank creates its own segment and publishes its identity.
        me = process_identity(os.getpid())
        path = segment_path(self.shm_dir, token, self.rank)
        created: tuple[str, object]
        try:
            self._segments = [Segment(path, layout, create=True)]
            created = ("", (socket.gethostname(), me, sorted(os.sched_getaffinity(0))))
        except (CommError, OSError) as exc:
            created = (str(exc), None)
        try:
            info = self._agree(created, "create its shared-memory segment")
            hosts = {host for host, _, _ in info}
            if len(hosts) > 1:
                raise CommError(
                    f"the shm backend needs every rank on one host but ranks run on {sorted(hosts)}; use "
                    "backend='gloo' (or 'auto', which picks gloo across hosts)",
                    rank=self.rank,
                    op="shm init",
                )
            # 3. map the peers' segments, then unlink once everyone has mapped everything.
            opened: tuple[str, object] = ("", None)
            try:
                mapped = [
                    self._segments[0]
                    if p == self.rank
                    else Segment(segment_path(self.shm_dir, token, p), layout, create=False)
                    for p in range(self.world_size)
                ]
                self._segments = mapped
            except (CommError, OSError) as exc:
                opened = (str(exc), None)
            self._agree(opened, "map its peers' segments")
        finally:
            unlink_quietly(path)
        identities = [identity for _, identity, _ in info]
        cores = set().union(*(set(mask) for _, _, mask in info))
        own = self._segments[self.rank].words
        waiter = Waiter(
            self.rank,
            self.timeout,
            identities,
            read_abort=lambda p: int(self._segments[p].words[layout.ABORT]),
            set_abort=lambda code: own.__setitem__(layout.ABORT, code),
            crowded=self.world_size > len(cores),
        )
        self._phases = PhaseEngine(self.rank, layout, self._segments, waiter)
        self._threads = ThreadLimit(threads_per_rank(self.world_size))
        self._p2p = P2PEngine(self.rank, layout, self._segments, self._phases, self._threads)
        self._phases.progress = self._p2p.progress
        self._phases.p2p_idle = lambda: self._p2p.idle
        return layout

    def close(self) -> None:
        """Unmap the segments (already unlinked: the memory goes when the last rank unmaps) and drop the
        control group (see :meth:`NativeCommunicator.close` for why a group must not outlive the job)."""
        if self._closed:
            return
        self._closed = True
        self.group = None
        own = self._segments[self.rank].words
        if int(own[self.layout.ABORT]) == 0:  # keep a failure code if one is set
            own[self.layout.ABORT] = ABORT_CLOSED  # peers still waiting on us fail now, not at the timeout
        del self._phases, self._p2p
        for segment in self._segments:
            segment.close()
        self._segments = []

    def _engine(self, op: str) -> PhaseEngine:
        if self._closed:
            raise CommError("the communicator is closed", rank=self.rank, op=op)
        return self._phases

    def _run(self, op: str, body: Callable[[PhaseEngine], None]) -> Work:
        engine = self._engine(op)
        if self.world_size > 1:
            with self._threads:
                body(engine)
        return _COMPLETED

    # ------------------------------------------------------------------ point to point
    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        self._engine("send")
        return self._p2p.isend(tensor, dst, tag)

    def _irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work:
        self._engine("recv")
        return self._p2p.irecv(tensor, src, tag)

    # ------------------------------------------------------------------ collectives
    def _broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        return self._run("broadcast", lambda e: collectives.broadcast(e, tensor.view(-1), root))

    def _reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp) -> Work:
        return self._run("reduce", lambda e: collectives.reduce(e, tensor.view(-1), root, op))

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        return self._run("all_reduce", lambda e: collectives.all_reduce(e, tensor.view(-1), op))

    def _all_reduce_into(self, source: torch.Tensor, output: torch.Tensor, op: ReduceOp) -> Work:
        if self.world_size == 1 or overlap(source, output):
            return super()._all_reduce_into(source, output, op)
        return self._run(
            "all_reduce", lambda e: collectives.all_reduce(e, output.view(-1), op, source=source.view(-1))
        )

    def _all_gather(self, outputs: list[torch.Tensor], input: torch.Tensor) -> Work:
        if self.world_size == 1 and outputs[0].data_ptr() != input.data_ptr():
            outputs[0].view(-1).copy_(input.view(-1))
        return self._run("all_gather", lambda e: collectives.all_gather(e, outputs, input.view(-1)))

    def _reduce_scatter(self, output: torch.Tensor, inputs: list[torch.Tensor], op: ReduceOp) -> Work:
        if self.world_size == 1:
            output.view(-1).copy_(inputs[0].view(-1))
        return self._run(
            "reduce_scatter", lambda e: collectives.reduce_scatter(e, output.view(-1), inputs, op)
        )

    def _all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Work:
        if self.world_size == 1:
            outputs[0].view(-1).copy_(inputs[0].view(-1))
        return self._run("all_to_all", lambda e: collectives.all_to_all(e, outputs, inputs))

    def _scatter(self, output: torch.Tensor, inputs: list[torch.Tensor] | None, root: int) -> Work:
        if self.world_size == 1 and inputs is not None:
            output.view(-1).copy_(inputs[0].view(-1))
        return self._run("scatter", lambda e: collectives.scatter(e, output.view(-1), inputs, root))

    def _gather(self, input: torch.Tensor, outputs: list[torch.Tensor] | None, root: int) -> Work:
        if self.world_size == 1 and outputs is not None:
            outputs[0].view(-1).copy_(input.view(-1))
        return self._run("gather", lambda e: collectives.gather(e, input.view(-1), outputs, root))

    def _barrier(self) -> Work:
        return self._run("barrier", collectives.barrier)

    def _split(self, ranks: list[int]) -> Communicator | None:
        global_ranks = [self._globals[r] for r in ranks]
        group = dist.new_group(
            global_ranks, timeout=datetime.timedelta(seconds=self.timeout), use_local_synchronization=True
        )
        if self.rank not in ranks:
            return None
        return ShmCommunicator(
            group,
            timeout=self.timeout,
            segment_bytes=self.segment_bytes,
            shm_dir=self.shm_dir,
            free_space=self._free_space,
            order=global_ranks,
        )
