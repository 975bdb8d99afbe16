"""Run a pipeline :class:`Schedule` on this rank's chunks over a Communicator (docs/pipeline.md, Executor).

Sends are posted as soon as their data exists and waited only when the step ends, so neighbours cannot
deadlock on each other; receives are posted ahead of need (:data:`RECV_LOOKAHEAD`, in program order, so a
pair's messages still match in order), so a message lands while this rank computes. Nothing synchronises
per micro-batch: the last chunk's loss (scaled by 1/m: the accumulated gradients are the batch's) stays a
tensor until the step's one collective, the status all-reduce, which also carries it to every rank.

**Failure.** Every message ends in three floats: a status and, when set, the chunk and micro-batch where
a failure started. A rank whose compute raises sends that *poison* to its neighbours instead of their
data; a receiver forwards it and stops; ranks past their last receive learn of it from the status
all-reduce (MAX over pp, then dp). So every rank raises :class:`PipelineFailure` naming where it started,
within one message latency instead of a timeout — bad batches too. The pairs may then hold messages
nobody received: restart the job (a new communicator) before training on.
"""

from __future__ import annotations

import functools
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
_MAX_DIMS = 8  # of an activation shape, as chunk 0's rank broadcasts it
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

    ``loss_fn(output, target)`` runs on the last chunk. ``dp`` and ``experts``: the stage's replicas, as
    :class:`~.stage_reducer.StageReducers` takes them. ``tied`` are this rank's copies of a weight shared
    by the first and last chunk on different ranks (see :func:`partition.tied_parameters`).
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
        self.chunks = dict(zip(schedule.local_chunks(pp.rank), chunks, strict=True))
        self.schedule, self.pp, self.dp, self.loss_fn = schedule, pp, dp, loss_fn
        self.tied, self.dtype = list(tied), dtype
        #: where the tied copies' accumulated gradients are read and summed: ``.grad`` by default; a
        #: wrapper that takes gradients from autograd into buffers of its own (ZeRO) points it there
        self.gradient_of: Callable[[torch.Tensor], torch.Tensor] = _grad
        self.rank = pp.rank
        self._split = SplitBackward(chunks) if schedule.split_backward else None
        self._shape: torch.Size | None = None  # of the hidden states at every boundary
        self._input_shape: torch.Size | None = None
        program = schedule.ranks[self.rank]
        self._neighbours = {i.peer for i in program if i.peer is not None}
        self._receives = [i for i in program if i.op in (Op.RECV_ACT, Op.RECV_GRAD)]
        self._tied_peer = 0 if self.rank == schedule.stages - 1 else schedule.stages - 1
        replicated = dp is not None and dp.world_size > 1
        self._reducers = StageReducers(self.chunks, dp, program, experts=experts) if replicated else None  # type: ignore[arg-type]

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
        on every rank. The batch may differ from the training one: its shape is broadcast first."""
        shape = self._share_shape(inputs.shape if inputs is not None else None)
        last = self.schedule.chunks - 1
        x, value = inputs, torch.zeros(1, dtype=torch.float64)
        sends: list[tuple[Work, torch.Tensor]] = []
        for c, chunk in self.chunks.items():
            if c > 0 and self.schedule.owner(c - 1) != self.rank:
                x = torch.empty(shape, dtype=self.dtype)  # type: ignore[arg-type]
                self.pp.recv(x, self.schedule.owner(c - 1))
            x = chunk(x)
            if c == last:
                value[0] = float(loss_fn(x, targets))  # type: ignore[arg-type]
            elif self.schedule.owner(c + 1) != self.rank:
                x = x.to(self.dtype).contiguous()
                sends.append((self.pp.isend(x, self.schedule.owner(c + 1)), x))
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
        self._post_tied(run)

    def _housekeeping(self, run: _StepState) -> None:
        """Top the posted receives up and drop finished sends, where it costs the pipeline nothing: never
        between a receive and the compute it feeds nor between a compute and the sends of its result (the
        hops a neighbour waits through; posting one gloo receive takes tens to hundreds of µs on a busy
        2-core machine)."""
        self._post_receives(run)
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
            out, record = self._split.forward(chunk, x) if self._split is not None else (chunk(x), [])
            if last:
                out = self.loss_fn(out, run.targets[k]) / self.schedule.micro_batches  # type: ignore[index]
                loss = out.detach()
                run.loss_sum = loss if run.loss_sum is None else run.loss_sum + loss
            elif self.schedule.owner(c + 1) == self.rank:  # next chunk on this rank: hand over directly
                run.received[(Op.RECV_ACT, c + 1, k)] = out.detach().requires_grad_()
            run.saved[(c, k)] = (x, out, record)
            run.held_bytes += x.nbytes + out.nbytes
            run.peak_bytes = max(run.peak_bytes, run.held_bytes)
        elif ins.op is Op.BACKWARD:
            x, out, record = run.saved[(c, k)]
            grad = None if last else run.received.pop((Op.RECV_GRAD, c, k))
            x_in = x if c > 0 else None
            if self._split is not None:
                dx = self._split.backward_input(chunk, record, out, grad, x_in)
            else:
                torch.autograd.backward(out, grad)
                dx = x.grad if c > 0 else None
            if not self.schedule.split_backward:
                self._release(run, c, k)
            if c > 0:  # chunk c − 1's output gradient: its backward's here, or a send's to another rank
                run.received[(Op.RECV_GRAD, c - 1, k)] = dx
        else:
            SplitBackward.backward_weight(run.saved[(c, k)][2])
            self._release(run, c, k)

    def _release(self, run: _StepState, c: int, k: int) -> None:
        x, out, _ = run.saved.pop((c, k))
        run.held_bytes -= x.nbytes + out.nbytes

    # ------------------------------------------------------------------ transfers
    def _send(self, run: _StepState, ins: Instruction) -> None:
        run.current = (ins.chunk, ins.micro_batch)
        data = (
            run.saved[(ins.chunk, ins.micro_batch)][1]
            if ins.op is Op.SEND_ACT
            else run.received.pop((Op.RECV_GRAD, ins.chunk - 1, ins.micro_batch))
        )
        buffer = _pack(data.detach(), self.dtype)
        run.sends.append((self.pp.isend(buffer, ins.peer), buffer))  # type: ignore[arg-type]

    def _post_receives(self, run: _StepState) -> None:
        """Post the program's next receives, in program order, until :data:`RECV_LOOKAHEAD` are in flight."""
        while len(run.posted) < RECV_LOOKAHEAD and run.next_receive < len(self._receives):
            ins = self._receives[run.next_receive]
            buffer = torch.empty(self._shape.numel() + _HEADER, dtype=self.dtype)  # type: ignore[union-attr]
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
        tensor = buffer[:-_HEADER].view(self._shape)  # type: ignore[arg-type]
        run.received[(ins.op, ins.chunk, ins.micro_batch)] = (
            tensor.requires_grad_() if ins.op is Op.RECV_ACT else tensor
        )

    def _poison(self, run: _StepState, chunk: int, k: int, *, skip: int | None) -> None:
        """Send every neighbour a message that says where the failure started."""
        if self._shape is None:
            return  # failed before the activation shape was known: the status all-reduce tells everyone
        size = self._shape.numel() + _HEADER
        for peer in self._neighbours - {skip}:
            buffer = torch.zeros(size, dtype=self.dtype)
            buffer[-_HEADER:] = torch.tensor([1.0, chunk, k], dtype=self.dtype)
            run.sends.append((self.pp.isend(buffer, peer), buffer))

    def _finish_status(self, run: _StepState, failure: PipelineFailure | None) -> float:
        """MAX over pp (then dp) of [failure code, loss]: every rank learns of a failure and the loss."""
        m = self.schedule.micro_batches
        code = 0.0 if failure is None else 1.0 + failure.chunk * m + failure.micro_batch
        loss = float("-inf") if run.loss_sum is None else float(run.loss_sum)  # on the last chunk's rank
        status = torch.tensor([code, loss], dtype=torch.float64)
        self.pp.all_reduce(status, ReduceOp.MAX)
        if self.dp is not None and self.dp.world_size > 1:
            self.dp.all_reduce(status[:1], ReduceOp.MAX)
        if failure is None and status[0] > 0:
            chunk, k = divmod(int(status[0].item()) - 1, m)
            raise PipelineFailure(self.schedule.owner(chunk), chunk, k, "raised on another rank")
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
        m, problem = self.schedule.micro_batches, None
        last = self.schedule.chunks - 1
        for what, values, here in (
            ("inputs", inputs, 0 in self.chunks),
            ("targets", targets, last in self.chunks),
        ):
            if here and problem is None and (values is None or len(values) != m):
                got = "none" if values is None else len(values)
                problem = (
                    f"this rank holds chunk 0 or the last chunk and needs {m} micro-batch {what}, got {got}"
                )
        shape = inputs[0].shape if 0 in self.chunks and problem is None else None  # type: ignore[index]
        if self._shape is None:
            self._input_shape, self._shape = shape, self._share_shape(shape)
        elif problem is None and shape is not None and shape != self._input_shape:
            problem = (
                f"micro-batch shape changed from {tuple(self._input_shape or ())} to {tuple(shape)}; "
                "build a new executor for a new shape"
            )
        if problem is not None:
            raise ValueError(f"rank {self.rank}: {problem}")

    def _share_shape(self, input_shape: torch.Size | None) -> torch.Size | None:
        """Chunk 0's output shape for ``input_shape``, known on chunk 0's rank, broadcast to every rank: the
        shape at every boundary (a :class:`~.partition.LayerChunk` past the first keeps its input's).

        Chunk 0's rank without a shape broadcasts ``ndim = −1``: every rank stops together (the status
        all-reduce), the others naming chunk 0's, which raises its own reason.
        """
        first = self.chunks.get(0)
        shape = None if first is None or input_shape is None else first.output_shape(input_shape)  # type: ignore[operator]
        meta = torch.full((_MAX_DIMS + 1,), -1, dtype=torch.int64)
        if shape is not None and len(shape) <= _MAX_DIMS:
            meta[0] = len(shape)
            meta[1 : 1 + len(shape)] = torch.tensor(list(shape))
        self.pp.broadcast(meta, root=0)
        if int(meta[0]) >= 0:
            return torch.Size(meta[1 : 1 + int(meta[0])].tolist())
        if shape is not None:
            raise ValueError(
                f"pipeline activations of {len(shape)} dims are not supported (at most {_MAX_DIMS})"
            )
        if 0 not in self.chunks:
            raise PipelineFailure(0, 0, 0, "the rank of chunk 0 could not start this step")
        return None


class _StepState:
    """Everything one step keeps between instructions."""

    def __init__(self, inputs: Sequence[torch.Tensor] | None, targets: Sequence[torch.Tensor] | None) -> None:
        self.inputs, self.targets = inputs, targets
        #: (receive op, chunk, micro-batch) → its data, received or handed over on this rank
        self.received: dict[tuple[Op, int, int], torch.Tensor] = {}
        #: (chunk, micro-batch) → its input, output and (split backward) Linear record, until its backward
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, SplitRecord]] = {}
        self.sends: list[tuple[Work, torch.Tensor]] = []
        self.posted: deque[tuple[Instruction, torch.Tensor, Work]] = deque()  # receives in flight, in order
        self.next_receive = 0  # index of the next receive of the program to post
        self.loss_sum: torch.Tensor | None = None
        self.tied_works: list[Work] = []  # sends of this rank's tied gradient
        self.events: list[Event] = []
        self.current: tuple[int, int] = (0, 0)
        self.poison_from: int | None = None
        self.t0 = 0.0
        self.held_bytes = 0
        self.peak_bytes = 0


def _pack(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` flattened, followed by an all-clear header, in one new buffer.

    One ``cat`` instead of allocate, copy and fill: a pack sits between a compute and the neighbour
    waiting for its result, and each torch call costs tens of µs there on a busy CPU."""
    flat = tensor.reshape(-1)
    return torch.cat((flat if flat.dtype == dtype else flat.to(dtype), _clear_header(dtype)))


@functools.cache
def _clear_header(dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(_HEADER, dtype=dtype)


def _grad(p: torch.Tensor) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad
