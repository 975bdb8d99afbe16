"""Run a pipeline :class:`Schedule` on this rank's chunks over a Communicator.

Per step: the instruction list is executed in order. Sends are posted (``isend``) as soon as their data
is computed and never waited until the end of the step, so neighbours cannot deadlock on each other.
Receives are posted *ahead of need*: up to :data:`RECV_LOOKAHEAD` of the program's next receives are in
flight, so a message lands while this rank computes and the wait before the compute that needs it is
usually zero (posted in program order, so messages between a pair still match in order). Posting and
reaping happen off the critical path: never between a receive and the compute it feeds, nor between a
compute and the sends of its result. Activation shapes are exchanged once, along the chain of chunks, on
the first step; the loss stays a tensor until the step ends (no device synchronisation per micro-batch).

The loss is computed on the last chunk, scaled by 1/m so that gradients accumulated over the micro-batches
equal those of the whole batch. With ``dp`` (the stage's data-parallel replicas) each chunk's gradients
are averaged by DataParallel's bucketed reducer (:mod:`~meshwise.parallel.pipeline_parallel.stage_reducer`;
with ``experts`` the expert parameters by a second one, over the ranks holding the same experts):
buckets launch during the chunk's last backward (its last weight-gradient pass under a split backward)
and are awaited once this rank's compute is over. Then the tied embedding/head gradient — averaged on both
ends: the sum of the averages is the average of the sums — is summed between the ranks holding the two
ends. The loss returned is this replica's (a caller averaging it over the replicas, as the GPT loop does).

**Failure.** Every message carries three trailing floats: a status and, when set, the chunk and
micro-batch where a failure started. A rank whose compute raises sends such a *poison* message to its
neighbours instead of the data they wait for; a rank that receives one forwards it and stops. Ranks past
their last receive learn of it from a small status all-reduce (MAX over pp, then dp) that every rank joins
at the end of each step. So every rank raises :class:`PipelineFailure` naming the stage and micro-batch
within one message latency, and nobody sits in a receive until the timeout. Bad batches (a missing or
short list of micro-batches, a new shape) fail the same way, on every rank. After a failure the pairs
may still hold messages nobody received: build a new communicator (restart the job) before training on.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from meshwise.comm.api import Communicator, ReduceOp, Work
from meshwise.parallel.expert_parallel import ExpertReplicas
from meshwise.parallel.pipeline_parallel.schedules import Instruction, Op, Schedule
from meshwise.parallel.pipeline_parallel.split_backward import SplitBackward, SplitRecord
from meshwise.parallel.pipeline_parallel.stage_reducer import StageReducers

_HEADER = 3  # status, chunk, micro-batch
_MAX_DIMS = 8
_WAIT_WORTH_RECORDING = 20e-6  # seconds; shorter receive waits would only clutter the trace
#: Receives kept posted ahead of the compute that needs them: one per neighbour direction in 1F1B's
#: steady state (an activation from the previous stage, a gradient from the next), at the memory cost of
#: that many boundary-sized buffers.
RECV_LOOKAHEAD = 2


_LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PipelineFailure(RuntimeError):
    """A stage failed; every rank of the pipeline raises this, naming where it started."""

    def __init__(self, stage: int, chunk: int, micro_batch: int, detail: str = "") -> None:
        where = f"pipeline stage {stage} (chunk {chunk}) failed on micro-batch {micro_batch}"
        super().__init__(f"{where}: {detail}" if detail else where)
        self.stage, self.chunk, self.micro_batch = stage, chunk, micro_batch


@dataclass(frozen=True)
class Event:
    """One compute instruction (F, B, W) or a wait for a receive ("wait") as it ran, in wall-clock
    seconds (so ranks line up: exactly on one host, to NTP's precision across hosts)."""

    rank: int
    op: str
    micro_batch: int
    chunk: int
    start: float
    end: float


@dataclass
class StepResult:
    loss: float  # mean over micro-batches, known on every rank of the pipeline (this replica's)
    events: list[Event] = field(default_factory=list)
    peak_activation_bytes: int = 0  # most bytes of chunk inputs/outputs held for backward at once


class PipelineExecutor:
    """Executes ``schedule`` for rank ``pp.rank`` holding ``chunks`` (its chunks, in global order).

    ``loss_fn(output, target)`` runs on the last chunk. ``dp`` (optional) averages each chunk's gradients
    across the pipeline replicas in buckets, overlapped with the step's last backward passes; ``experts``
    (with experts spread over ep, ``dp`` then holding dp·ep·cp) averages the expert parameters' apart,
    over the ranks that hold the same experts. ``tied``
    are this rank's copies of a weight shared by the first and last chunk on different ranks (see
    :func:`partition.tied_parameters`).
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        schedule: Schedule,
        pp: Communicator,
        loss_fn: _LossFn,
        *,
        dp: Communicator | None = None,
        experts: ExpertReplicas | None = None,
        tied: Sequence[torch.Tensor] = (),
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if pp.world_size != schedule.stages:
            raise ValueError(
                f"a {schedule.stages}-stage schedule needs a pp group of {schedule.stages} ranks, "
                f"got {pp.world_size}"
            )
        ids = schedule.local_chunks(pp.rank)
        if len(chunks) != len(ids):
            raise ValueError(f"rank {pp.rank} runs chunks {ids} but was given {len(chunks)} modules")
        self.chunks = dict(zip(ids, chunks, strict=True))
        self.schedule, self.pp, self.dp, self.loss_fn = schedule, pp, dp, loss_fn
        self.tied, self.dtype = list(tied), dtype
        #: where the tied copies' accumulated gradients are read and summed: ``.grad`` by default; a
        #: wrapper that takes gradients from autograd into buffers of its own (ZeRO) points it there
        self.gradient_of: Callable[[torch.Tensor], torch.Tensor] = _grad
        self.rank = pp.rank
        self._split = SplitBackward(chunks) if schedule.split_backward else None
        self._shapes: dict[int, torch.Size] = {}  # chunk → shape of its output (hidden states)
        self._input_shape: torch.Size | None = None
        self._neighbours = {i.peer for i in schedule.ranks[self.rank] if i.peer is not None}
        self._receives = [i for i in schedule.ranks[self.rank] if i.op in (Op.RECV_ACT, Op.RECV_GRAD)]
        self._tied_peer = 0 if self.rank == schedule.stages - 1 else schedule.stages - 1
        replicated = dp is not None and dp.world_size > 1
        program = schedule.ranks[self.rank]
        self._reducers = (
            StageReducers(self.chunks, dp, program, experts=experts) if replicated else None  # type: ignore[arg-type]
        )

    # ------------------------------------------------------------------ public
    def step(
        self, inputs: Sequence[torch.Tensor] | None, targets: Sequence[torch.Tensor] | None
    ) -> StepResult:
        """One optimizer step's forward and backward over ``m`` micro-batches; gradients accumulate in
        ``.grad``. ``inputs`` is needed on the rank of chunk 0, ``targets`` on the rank of the last chunk."""
        run = _StepState(inputs, targets)
        run.current = (min(self.chunks), 0)
        failure: PipelineFailure | None = None
        try:
            self._check_step(inputs, targets)
            self._run(run)
        except PipelineFailure as remote:
            failure = remote
            self._poison(run, remote.chunk, remote.micro_batch, skip=run.poison_from)
        except Exception as exc:
            chunk, k = run.current
            failure = PipelineFailure(self.rank, chunk, k, f"{type(exc).__name__}: {exc}")
            failure.__cause__ = exc
            self._poison(run, chunk, k, skip=None)
        if failure is not None and self._reducers is not None:
            self._reducers.abort()  # the replicas' collectives stay matched before the status all-reduce
        loss = self._finish_status(run, failure)
        if failure is not None:
            raise failure
        self._wait_all(run.sends)
        self._sync_tied(run)
        return StepResult(loss, run.events, run.peak_bytes)

    @torch.no_grad()
    def forward_only(
        self, inputs: torch.Tensor | None, targets: torch.Tensor | None, loss_fn: _LossFn
    ) -> float:
        """``loss_fn(output, targets)`` of one batch pushed once through every chunk (evaluation), known
        on every rank. Shapes travel with each batch, so the batch may differ from the training one."""
        last = self.schedule.chunks - 1
        x, value = inputs, torch.zeros(1, dtype=torch.float64)
        sends: list[tuple[Work, torch.Tensor]] = []
        for c in range(self.schedule.chunks):
            owner = self.schedule.owner(c)
            if owner != self.rank:
                continue
            if c > 0 and self.schedule.owner(c - 1) != self.rank:
                meta = torch.empty(_MAX_DIMS + 1, dtype=torch.int64)
                self.pp.recv(meta, self.schedule.owner(c - 1))
                x = torch.empty(meta[1 : 1 + int(meta[0])].tolist(), dtype=self.dtype)
                self.pp.recv(x, self.schedule.owner(c - 1))
            x = self.chunks[c](x)
            if c == last:
                value[0] = float(loss_fn(x, targets))  # type: ignore[arg-type]
            elif self.schedule.owner(c + 1) != self.rank:
                x = x.to(self.dtype).contiguous()
                for message in (_shape_tensor(x.shape), x):
                    sends.append((self.pp.isend(message, self.schedule.owner(c + 1)), message))
        self._wait_all(sends)
        self.pp.broadcast(value, root=self.schedule.owner(last))
        return float(value.item())

    def close(self) -> None:
        if self._split is not None:
            self._split.close()

    # ------------------------------------------------------------------ schedule
    def _run(self, run: _StepState) -> None:
        program = self.schedule.ranks[self.rank]
        run.t0 = time.perf_counter() - time.time()  # perf_counter() - t0: wall clock, perf_counter resolution
        self._post_receives(run, RECV_LOOKAHEAD)
        after_receive = False
        for ins in program:
            if ins.op in (Op.SEND_ACT, Op.SEND_GRAD):
                self._send(run, ins)
                continue
            if ins.op in (Op.RECV_ACT, Op.RECV_GRAD):
                self._housekeeping(run)
                self._receive(run, ins)
                after_receive = True
                continue
            if not after_receive:
                self._housekeeping(run)
            after_receive = False
            run.current = (ins.chunk, ins.micro_batch)
            gradients = self._reducers is not None and ins.op is not Op.FORWARD
            if gradients:
                self._reducers.before(ins)  # type: ignore[union-attr]
            start = time.perf_counter()
            self._compute(run, ins)
            end = time.perf_counter()
            run.events.append(
                Event(self.rank, ins.op.value, ins.micro_batch, ins.chunk, start - run.t0, end - run.t0)
            )
            if gradients:
                self._reducers.after(ins)  # type: ignore[union-attr]
        run.loss = float(run.loss_sum.item()) if run.loss_sum is not None else 0.0
        self._post_tied(run)

    def _housekeeping(self, run: _StepState) -> None:
        """Top the posted receives up and drop finished sends, where it costs the pipeline nothing.

        Done before a receive's wait and before a compute, but never between a receive and the compute it
        feeds nor between a compute and the sends of its result: those hops are on the pipeline's critical
        path, and posting one gloo receive takes tens to hundreds of µs on a busy 2-core machine, time the
        neighbour would wait. What gets posted is the receive after the next one, so the next one is still
        in flight while this rank computes."""
        self._post_receives(run, RECV_LOOKAHEAD)
        run.sends = [(w, t) for w, t in run.sends if not w.is_completed()]  # also drives shm progress

    def _post_tied(self, run: _StepState) -> None:
        """Send the tied weight's gradient as soon as this rank's last backward is done: the last stage
        finishes long before the first, so its half has arrived by the time the first stage (the last
        rank to finish a step) asks for it. The receive is posted only after the status all-reduce, so it
        can never take a failing neighbour's poison message in place of the gradient. With replicas the
        gradients' averages are awaited first: each end sends its averaged half."""
        if self._reducers is not None:
            self._reducers.wait()
        if self.tied:
            run.tied_works = [self.pp.isend(self.gradient_of(p), self._tied_peer) for p in self.tied]

    def _compute(self, run: _StepState, ins: Instruction) -> None:
        c, k = ins.chunk, ins.micro_batch
        chunk, last = self.chunks[c], c == self.schedule.chunks - 1
        if ins.op is Op.FORWARD:
            x = run.inputs[k] if c == 0 else run.received.pop((Op.RECV_ACT, c, k))  # type: ignore[index]
            if self._split is not None:
                out, run.records[(c, k)] = self._split.forward(chunk, x)
            else:
                out = chunk(x)
            if last:
                out = self.loss_fn(out, run.targets[k]) / self.schedule.micro_batches  # type: ignore[index]
                loss = out.detach()
                run.loss_sum = loss if run.loss_sum is None else run.loss_sum + loss
            elif self.schedule.owner(c + 1) == self.rank:  # next chunk on this rank: hand over directly
                run.received[(Op.RECV_ACT, c + 1, k)] = out.detach().requires_grad_()
            run.saved[(c, k)] = (x, out)
            run.held_bytes += _bytes(x) + _bytes(out)
            run.peak_bytes = max(run.peak_bytes, run.held_bytes)
        elif ins.op is Op.BACKWARD:
            x, out = run.saved[(c, k)]
            grad = None if last else run.received.pop((Op.RECV_GRAD, c, k))
            x_in = x if c > 0 else None
            if self._split is not None:
                dx = self._split.backward_input(chunk, run.records[(c, k)], out, grad, x_in)
            else:
                torch.autograd.backward(out, grad)
                dx = x.grad if c > 0 else None
            if not self.schedule.split_backward:
                self._release(run, c, k)
            if c > 0 and self.schedule.owner(c - 1) == self.rank:
                run.received[(Op.RECV_GRAD, c - 1, k)] = dx
            else:
                run.grads[(c, k)] = dx
        else:
            record: SplitRecord = run.records.pop((c, k))
            SplitBackward.backward_weight(record)
            self._release(run, c, k)

    def _release(self, run: _StepState, c: int, k: int) -> None:
        x, out = run.saved.pop((c, k))
        run.held_bytes -= _bytes(x) + _bytes(out)

    # ------------------------------------------------------------------ transfers
    def _send(self, run: _StepState, ins: Instruction) -> None:
        run.current = (ins.chunk, ins.micro_batch)
        data = (
            run.saved[(ins.chunk, ins.micro_batch)][1]
            if ins.op is Op.SEND_ACT
            else run.grads.pop((ins.chunk, ins.micro_batch))
        )
        buffer = _pack(data.detach(), self.dtype)
        run.sends.append((self.pp.isend(buffer, ins.peer), buffer))  # type: ignore[arg-type]

    def _post_receives(self, run: _StepState, ahead: int) -> None:
        """Post the program's next receives, in program order, until ``ahead`` are in flight."""
        while len(run.posted) < ahead and run.next_receive < len(self._receives):
            ins = self._receives[run.next_receive]
            buffer = torch.empty(self._boundary(ins).numel() + _HEADER, dtype=self.dtype)
            run.posted.append((ins, buffer, self.pp.irecv(buffer, ins.peer)))  # type: ignore[arg-type]
            run.next_receive += 1

    def _receive(self, run: _StepState, ins: Instruction) -> None:
        run.current = (ins.chunk, ins.micro_batch)
        posted, buffer, work = run.posted.popleft()  # topped up just before: never empty here
        assert posted is ins, f"receive {ins} out of program order (posted {posted})"
        start = time.perf_counter()
        work.wait()
        end = time.perf_counter()
        if end - start > _WAIT_WORTH_RECORDING:
            run.events.append(
                Event(self.rank, "wait", ins.micro_batch, ins.chunk, start - run.t0, end - run.t0)
            )
        status, chunk, k = buffer[-_HEADER:].tolist()
        if status:
            run.poison_from = ins.peer
            raise PipelineFailure(self.schedule.owner(int(chunk)), int(chunk), int(k))
        tensor = buffer[:-_HEADER].view(self._boundary(ins))
        run.received[(ins.op, ins.chunk, ins.micro_batch)] = (
            tensor.requires_grad_() if ins.op is Op.RECV_ACT else tensor
        )

    def _boundary(self, ins: Instruction) -> torch.Size:
        """Shape of what a receive gets: the previous chunk's output, or the gradient of this one's."""
        return self._shapes[ins.chunk - 1 if ins.op is Op.RECV_ACT else ins.chunk]

    def _poison(self, run: _StepState, chunk: int, k: int, *, skip: int | None) -> None:
        """Send every neighbour a message that says where the failure started."""
        if not self._shapes:
            return  # failed before any activation shape was known: the status all-reduce tells everyone
        size = next(iter(self._shapes.values())).numel() + _HEADER  # every boundary has one shape
        for peer in self._neighbours - {skip}:
            buffer = torch.zeros(size, dtype=self.dtype)
            buffer[-_HEADER:] = torch.tensor([1.0, chunk, k], dtype=self.dtype)
            run.sends.append((self.pp.isend(buffer, peer), buffer))

    def _finish_status(self, run: _StepState, failure: PipelineFailure | None) -> float:
        """MAX over pp (then dp) of [failure code, loss]: every rank learns of a failure and the loss."""
        m = self.schedule.micro_batches
        code = 0.0 if failure is None else 1.0 + failure.chunk * m + failure.micro_batch
        has_loss = self.schedule.chunks - 1 in self.chunks
        status = torch.tensor([code, run.loss if has_loss else float("-inf")], dtype=torch.float64)
        self.pp.all_reduce(status, ReduceOp.MAX)
        if self.dp is not None and self.dp.world_size > 1:
            self.dp.all_reduce(status[:1], ReduceOp.MAX)
        if failure is None and status[0] > 0:
            chunk, k = divmod(int(status[0].item()) - 1, m)
            failure = PipelineFailure(self.schedule.owner(chunk), chunk, k, "raised on another rank")
            raise failure
        return float(status[1].item())

    def _wait_all(self, sends: list[tuple[Work, torch.Tensor]]) -> None:
        for work, _ in sends:
            work.wait()
        sends.clear()

    # ------------------------------------------------------------------ gradients
    def _sync_tied(self, run: _StepState) -> None:
        """Sum the tied weight's two copies (exchange posted by :meth:`_post_tied`)."""
        theirs = [torch.empty_like(self.gradient_of(p)) for p in self.tied]
        for w in run.tied_works + [self.pp.irecv(t, self._tied_peer) for t in theirs]:
            w.wait()
        for p, t in zip(self.tied, theirs, strict=True):
            self.gradient_of(p).add_(t)

    def _check_step(
        self, inputs: Sequence[torch.Tensor] | None, targets: Sequence[torch.Tensor] | None
    ) -> None:
        """Inputs where chunk 0 lives, targets where the last chunk lives, one shape for every step.

        Runs inside the failure protocol, so a bad batch on one rank stops every rank with its message.
        """
        m = self.schedule.micro_batches
        problem = None
        if 0 in self.chunks:
            problem = _micro_batch_problem("inputs", inputs, m)
        if problem is None and self.schedule.chunks - 1 in self.chunks:
            problem = _micro_batch_problem("targets", targets, m)
        shape = inputs[0].shape if 0 in self.chunks and problem is None else None  # type: ignore[index]
        if not self._shapes:
            self._exchange_shapes(shape)
        elif problem is None and shape is not None and shape != self._input_shape:
            problem = (
                f"micro-batch shape changed from {tuple(self._input_shape or ())} to {tuple(shape)}; "
                "build a new executor for a new shape"
            )
        if problem is not None:
            raise ValueError(f"rank {self.rank}: {problem}")

    def _exchange_shapes(self, input_shape: torch.Size | None) -> None:
        """Once: the output shape of every chunk, passed down the chain of chunks.

        A rank that cannot compute its shape sends ``ndim = −1`` instead and every rank downstream passes
        it on, so all ranks finish the chain and then stop together (the status all-reduce).
        """
        self._input_shape = input_shape
        shape, broken = input_shape, 0 in self.chunks and input_shape is None  # chunk 0 got no inputs
        for c in range(self.schedule.chunks - 1):
            owner, receiver = self.schedule.owner(c), self.schedule.owner(c + 1)
            if owner == self.rank:
                shape = None if broken else self.chunks[c].output_shape(shape)  # type: ignore[operator]
                if receiver != self.rank:
                    self.pp.send(_shape_tensor(shape), receiver)
            if receiver == self.rank and owner != self.rank:
                meta = torch.empty(_MAX_DIMS + 1, dtype=torch.int64)
                self.pp.recv(meta, owner)
                broken = broken or int(meta[0]) < 0
                shape = None if broken else torch.Size(meta[1 : 1 + int(meta[0])].tolist())
            if shape is not None and self.rank in (owner, receiver):
                self._shapes[c] = shape
        if broken:  # every rank knows: no poison needed, and the next step exchanges again
            self._shapes.clear()
            if 0 not in self.chunks:
                raise PipelineFailure(0, 0, 0, "the rank of chunk 0 could not start this step")
        if len(set(self._shapes.values())) > 1:
            raise ValueError(
                f"pipeline chunks hand over different shapes {sorted(set(self._shapes.values()))}; "
                "the executor needs one activation shape at every boundary"
            )


class _StepState:
    """Everything one step keeps between instructions."""

    def __init__(self, inputs: Sequence[torch.Tensor] | None, targets: Sequence[torch.Tensor] | None) -> None:
        self.inputs, self.targets = inputs, targets
        self.received: dict[tuple[Op, int, int], torch.Tensor] = {}
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.grads: dict[tuple[int, int], torch.Tensor] = {}
        self.records: dict[tuple[int, int], SplitRecord] = {}
        self.sends: list[tuple[Work, torch.Tensor]] = []
        self.posted: deque[tuple[Instruction, torch.Tensor, Work]] = deque()  # receives in flight, in order
        self.next_receive = 0  # index of the next receive of the program to post
        self.loss_sum: torch.Tensor | None = None
        self.tied_works: list[Work] = []  # sends of this rank's tied gradient
        self.events: list[Event] = []
        self.current: tuple[int, int] = (0, 0)
        self.poison_from: int | None = None
        self.loss = 0.0
        self.t0 = 0.0
        self.held_bytes = 0
        self.peak_bytes = 0


def _pack(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` flattened, followed by an all-clear header, in one new buffer.

    One ``cat`` instead of allocate, copy and fill: a pack sits between a compute and the neighbour
    waiting for its result, and each torch call costs tens of µs there on a busy CPU."""
    header = _CLEAR_HEADERS.get(dtype)
    if header is None:
        header = _CLEAR_HEADERS[dtype] = torch.zeros(_HEADER, dtype=dtype)
    flat = tensor.reshape(-1)
    return torch.cat((flat if flat.dtype == dtype else flat.to(dtype), header))


_CLEAR_HEADERS: dict[torch.dtype, torch.Tensor] = {}


def _micro_batch_problem(what: str, values: Sequence[torch.Tensor] | None, m: int) -> str | None:
    if values is None or len(values) != m:
        got = "none" if values is None else len(values)
        return f"this rank holds chunk 0 or the last chunk and needs {m} micro-batch {what}, got {got}"
    return None


def _shape_tensor(shape: torch.Size | None) -> torch.Tensor:
    """``[ndim, d0, d1, …]``; ``ndim = −1`` says the sender could not start the step."""
    meta = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64)
    if shape is None:
        meta[0] = -1
        return meta
    if len(shape) > _MAX_DIMS:
        raise ValueError(f"pipeline activations of {len(shape)} dims are not supported (at most {_MAX_DIMS})")
    meta[0] = len(shape)
    meta[1 : 1 + len(shape)] = torch.tensor(list(shape))
    return meta


def _grad(p: torch.Tensor) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
