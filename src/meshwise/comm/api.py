"""The Communicator protocol: one interface for every backend, every algorithm and every group.

Parallel strategies (DDP, ZeRO, TP, PP) and the benchmarks talk only to a :class:`Communicator`, never to a
transport, so the same code runs on NCCL, gloo, shared memory or MPI. The public methods here do the
argument checking and normalisation once; a backend implements the small set of ``_``-prefixed primitives
on canonical arguments (contiguous tensors, per-rank lists) and returns a :class:`Work`.

Semantics follow the collective tables of the seeds and of NCCL/MPI:

=================  ==========================================================================================
broadcast          root's tensor is copied to every rank.
reduce             root's tensor becomes op(tensor of every rank); other ranks' tensors are left unchanged.
all_reduce         every rank's tensor (or ``output``) becomes op(tensor of every rank).
all_gather         rank r's input lands in slot r of every rank's output (flat: ``output`` concatenates the
                   slots along dim 0; list: one tensor per rank, sizes may differ).
reduce_scatter     rank i receives op over ranks of slot i of their inputs (seeds: rank r holds [r+1 … r+4]
                   on 4 ranks → rank i gets the sum of column i).
all_to_all         slot j of rank i's input lands in slot i of rank j's output (``all_to_all_single``: the
                   slots are row ranges of one tensor given by split sizes along dim 0, as in torch).
scatter / gather   root's slot i goes to rank i / rank i's tensor lands in root's slot i.
barrier            returns on every rank only once every rank has entered it.
=================  ==========================================================================================

Reductions of float16/bfloat16 accumulate in float32 and round once; AVG of integers is refused (use SUM
and divide) because there is no exact integer mean.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from meshwise.comm.collective import Collective as Collective
from meshwise.comm.splits import split_sizes

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64)
HALF_DTYPES = (torch.bfloat16, torch.float16)


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a reduction of ``dtype`` accumulates in, on every backend: float32 for the half types (so the
    result is rounded once, at the end, whatever the order of the ranks), ``dtype`` itself otherwise."""
    return torch.float32 if dtype in HALF_DTYPES else dtype


def accumulator(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in its :func:`accumulator_dtype`: a float32 copy of a half tensor, else itself."""
    return tensor.to(accumulator_dtype(tensor.dtype))


class ReduceOp(str, enum.Enum):
    """Element-wise reduction applied by reduce, all_reduce and reduce_scatter."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PROD = "prod"


class CommError(RuntimeError):
    """A collective or point-to-point operation failed; the message names the rank and the operation."""

    def __init__(self, message: str, *, rank: int | None = None, op: str | None = None) -> None:
        prefix = []
        if rank is not None:
            prefix.append(f"rank {rank}")
        if op is not None:
            prefix.append(op)
        super().__init__(f"[{' · '.join(prefix)}] {message}" if prefix else message)
        self.rank = rank
        self.op = op


class CommTimeoutError(CommError):
    """A wait ran past the communicator's timeout (a peer is slow, hung, or called another operation)."""


class PeerFailureError(CommError):
    """A peer process died while this rank waited for it."""


class CollectiveMismatchError(CommError):
    """Ranks called different collectives, or the same one with different sizes, dtypes or roots."""


class Work(ABC):
    """Handle of an operation started with ``async_op=True``."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until the operation finished (raises :class:`CommError` subclasses on failure)."""

    @abstractmethod
    def is_completed(self) -> bool:
        """True once the operation finished; never blocks."""


class CompletedWork(Work):
    """Work of an operation that already finished synchronously."""

    def wait(self, timeout: float | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class ChainedWork(Work):
    """Runs ``finish`` once after ``inner`` completes: how a backend adds post-processing (e.g. AVG = SUM
    then divide, or copying a float32 accumulator back into a half tensor) to an asynchronous operation."""

    def __init__(self, inner: Work, finish: Callable[[], None]) -> None:
        self._inner = inner
        self._finish: Callable[[], None] | None = finish

    def wait(self, timeout: float | None = None) -> None:
        self._inner.wait(timeout)
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()

    def is_completed(self) -> bool:
        return self._finish is None or self._inner.is_completed()


class AllWork(Work):
    """Completion of several works (e.g. one send per peer), waited in order under one deadline each."""

    def __init__(self, works: Sequence[Work]) -> None:
        self._works = list(works)

    def wait(self, timeout: float | None = None) -> None:
        for work in self._works:
            work.wait(timeout)
        self._works = []

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


TensorOrList = torch.Tensor | Sequence[torch.Tensor]


def as_tensor(value: object, what: str, op_name: str, rank: int) -> torch.Tensor:
    """``value`` as a tensor: a numpy array is wrapped with ``torch.from_numpy`` (no copy: a result
    written in place lands in the array); anything else that is not a tensor is refused by name."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        if not value.flags.writeable:  # torch cannot share it, and a result could not land in it
            raise ValueError(
                f"[rank {rank} · {op_name}] {what} is a read-only numpy array; pass array.copy()"
            )
        return torch.from_numpy(value)
    raise TypeError(
        f"[rank {rank} · {op_name}] {what} is a {type(value).__name__}, not a tensor; pass a torch.Tensor "
        "(or a numpy array, used through torch.from_numpy)"
    )


def check_dtype(tensor: torch.Tensor, op_name: str, rank: int) -> None:
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(
            f"[rank {rank} · {op_name}] dtype {tensor.dtype} is not supported; use one of {names}"
        )


def check_reduce_op(dtype: torch.dtype, op: ReduceOp | str, op_name: str, rank: int) -> ReduceOp:
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(
            f"[rank {rank} · {op_name}] unknown reduce op {op!r}; use one of {[o.value for o in ReduceOp]}"
        ) from None
    if op is ReduceOp.AVG and not dtype.is_floating_point:
        raise TypeError(
            f"[rank {rank} · {op_name}] AVG is not defined for integer dtype {dtype}: "
            "reduce with SUM and divide, or convert to a floating dtype"
        )
    return op


def _check_contiguous(tensor: torch.Tensor, what: str, op_name: str, rank: int) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"[rank {rank} · {op_name}] {what} must be contiguous; call .contiguous() first")


def split_slots(tensor: torch.Tensor, parts: int, what: str, op_name: str, rank: int) -> list[torch.Tensor]:
    """Views of ``tensor`` cut into ``parts`` equal slots along dim 0 (the flat, even-size form)."""
    if tensor.dim() == 0 or tensor.shape[0] % parts != 0:
        raise ValueError(
            f"[rank {rank} · {op_name}] {what} has shape {tuple(tensor.shape)}: dim 0 must be divisible by "
            f"the world size {parts}; pass a list of per-rank tensors for uneven sizes"
        )
    return list(tensor.chunk(parts, dim=0)) if parts > 1 else [tensor]


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte (then reading one while writing the other is unsafe)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


class Communicator(ABC):
    """A group of ``world_size`` ranks that can exchange tensors; this process is ``rank``.

    All methods must be called by every rank of the group in the same order (point-to-point excepted).
    Every wait honours ``timeout`` seconds and turns a dead, hung or mismatched peer into a
    :class:`CommError` that names the rank and the operation.
    """

    backend: str = "abstract"
    #: Whether an ``async_op=True`` collective returns before its data has moved (torch's gloo and nccl
    #: engines, MPI's non-blocking requests), so that DDP can launch buckets while backward goes on.
    #: Where collectives run to completion on the calling thread (shm), DDP launches its buckets once
    #: backward ends instead: launched mid-backward they would overlap nothing and only add points
    #: where the ranks wait for one another.
    overlaps_compute: bool = True

    def __init__(self, rank: int, world_size: int, timeout: float) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of size {world_size}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout}")
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r})"
        )

    # ------------------------------------------------------------------ helpers
    def _check(self, tensor: torch.Tensor, what: str, op_name: str) -> torch.Tensor:
        """``tensor`` checked, a numpy array as the tensor that shares its memory (so a result written
        in place lands in the array the caller passed)."""
        tensor = as_tensor(tensor, what, op_name, self.rank)
        check_dtype(tensor, op_name, self.rank)
        _check_contiguous(tensor, what, op_name, self.rank)
        return tensor

    def _check_peer(self, peer: int, what: str, op_name: str) -> None:
        if not 0 <= peer < self.world_size:
            raise ValueError(
                f"[rank {self.rank} · {op_name}] {what}={peer} is outside 0..{self.world_size - 1}"
            )

    def _slots(self, value: TensorOrList, what: str, op_name: str) -> list[torch.Tensor]:
        if isinstance(value, torch.Tensor | np.ndarray):
            value = self._check(value, what, op_name)
            return split_slots(value, self.world_size, what, op_name, self.rank)
        slots = list(value)
        if len(slots) != self.world_size:
            raise ValueError(
                f"[rank {self.rank} · {op_name}] {what} holds {len(slots)} tensors; need one per rank "
                f"({self.world_size})"
            )
        return [self._check(slot, what, op_name) for slot in slots]

    def _same_dtype(self, tensors: Sequence[torch.Tensor], op_name: str) -> None:
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1:
            raise TypeError(f"[rank {self.rank} · {op_name}] tensors mix dtypes {sorted(map(str, dtypes))}")

    @staticmethod
    def _finish(work: Work, async_op: bool) -> Work | None:
        if async_op:
            return work
        work.wait()
        return None

    # ------------------------------------------------------------------ point to point
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.irecv(tensor, src, tag).wait()

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        tensor = self._check(tensor, "tensor", "send")
        self._check_peer(dst, "dst", "send")
        return self._isend(tensor, dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        tensor = self._check(tensor, "tensor", "recv")
        self._check_peer(src, "src", "recv")
        return self._irecv(tensor, src, tag)

    # ------------------------------------------------------------------ collectives
    def broadcast(self, tensor: torch.Tensor, root: int = 0, *, async_op: bool = False) -> Work | None:
        tensor = self._check(tensor, "tensor", "broadcast")
        self._check_peer(root, "root", "broadcast")
        return self._finish(self._broadcast(tensor, root), async_op)

    def reduce(
        self,
        tensor: torch.Tensor,
        root: int = 0,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
    ) -> Work | None:
        tensor = self._check(tensor, "tensor", "reduce")
        self._check_peer(root, "root", "reduce")
        op = check_reduce_op(tensor.dtype, op, "reduce", self.rank)
        return self._finish(self._reduce(tensor, root, op), async_op)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        output: torch.Tensor | None = None,
        async_op: bool = False,
    ) -> Work | None:
        """Reduce in place, or into ``output`` (same shape and dtype) leaving ``tensor`` untouched."""
        tensor = self._check(tensor, "tensor", "all_reduce")
        op = check_reduce_op(tensor.dtype, op, "all_reduce", self.rank)
        if output is not None:
            output = self._check(output, "output", "all_reduce")
            if output.shape != tensor.shape or output.dtype != tensor.dtype:
                raise ValueError(
                    f"[rank {self.rank} · all_reduce] output {tuple(output.shape)}/{output.dtype} must match "
                    f"tensor {tuple(tensor.shape)}/{tensor.dtype}"
                )
            return self._finish(self._all_reduce_into(tensor, output, op), async_op)
        return self._finish(self._all_reduce(tensor, op), async_op)

    def all_gather(self, output: TensorOrList, input: torch.Tensor, *, async_op: bool = False) -> Work | None:
        """Gather every rank's ``input`` into ``output``; in place when ``input`` is this rank's slot."""
        input = self._check(input, "input", "all_gather")
        slots = self._slots(output, "output", "all_gather")
        self._same_dtype([input, *slots], "all_gather")
        if slots[self.rank].numel() != input.numel():
            raise ValueError(
                f"[rank {self.rank} · all_gather] output slot {self.rank} holds {slots[self.rank].numel()} "
                f"elements but input has {input.numel()}"
            )
        return self._finish(self._all_gather(slots, input), async_op)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: TensorOrList,
        op: ReduceOp | str = ReduceOp.SUM,
        *,
        async_op: bool = False,
    ) -> Work | None:
        """Rank i receives the reduction of slot i of every rank's ``input``."""
        output = self._check(output, "output", "reduce_scatter")
        slots = self._slots(input, "input", "reduce_scatter")
        self._same_dtype([output, *slots], "reduce_scatter")
        op = check_reduce_op(output.dtype, op, "reduce_scatter", self.rank)
        if slots[self.rank].numel() != output.numel():
            raise ValueError(
                f"[rank {self.rank} · reduce_scatter] input slot {self.rank} holds "
                f"{slots[self.rank].numel()} elements but output has {output.numel()}"
            )
        return self._finish(self._reduce_scatter(output, slots, op), async_op)

    def all_to_all(self, output: TensorOrList, input: TensorOrList, *, async_op: bool = False) -> Work | None:
        """Slot j of this rank's ``input`` goes to rank j, landing in its ``output`` slot ``self.rank``."""
        outputs = self._slots(output, "output", "all_to_all")
        inputs = self._slots(input, "input", "all_to_all")
        self._same_dtype([*outputs, *inputs], "all_to_all")
        if outputs[self.rank].numel() != inputs[self.rank].numel():
            raise ValueError(
                f"[rank {self.rank} · all_to_all] the slot this rank sends to itself has "
                f"{inputs[self.rank].numel()} elements but its output slot holds {outputs[self.rank].numel()}"
            )
        return self._finish(self._all_to_all(outputs, inputs), async_op)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | torch.Tensor | None = None,
        input_split_sizes: Sequence[int] | torch.Tensor | None = None,
        *,
        async_op: bool = False,
    ) -> Work | None:
        """torch's ``all_to_all_single``: rows ``input_split_sizes[j]`` of ``input`` (in order along dim 0)
        go to rank j, which receives them into its ``output`` rows for this rank; ``None`` splits dim 0
        evenly. The uneven traffic of expert parallelism: every rank must know what it will receive, so
        exchange the counts first (an even all_to_all_single of one integer per rank). Ranks whose split
        sizes do not pair up get a :class:`CollectiveMismatchError` naming the pair, on every backend."""
        op = "all_to_all_single"
        output = self._check(output, "output", op)
        input = self._check(input, "input", op)
        self._same_dtype([output, input], op)
        if output.dim() == 0 or input.dim() == 0 or output.shape[1:] != input.shape[1:]:
            raise ValueError(
                f"[rank {self.rank} · {op}] output {tuple(output.shape)} and input {tuple(input.shape)} must "
                "have at least one dimension and the same sizes after dim 0"
            )
        outs = split_sizes(output_split_sizes, output.shape[0], self.world_size, "output", self.rank)
        ins = split_sizes(input_split_sizes, input.shape[0], self.world_size, "input", self.rank)
        if outs[self.rank] != ins[self.rank]:
            raise ValueError(
                f"[rank {self.rank} · {op}] this rank sends itself {ins[self.rank]} rows but expects "
                f"{outs[self.rank]}"
            )
        if overlap(output, input):
            raise ValueError(f"[rank {self.rank} · {op}] output and input share memory; use two tensors")
        outputs, inputs = list(output.split(outs)), list(input.split(ins))
        return self._finish(self._all_to_all(outputs, inputs), async_op)

    def scatter(
        self, output: Tensor, input: TensorOrList | None = None, root: int = 0, *, async_op: bool = False
    ) -> Work | None:
        """Root's slot i lands in rank i's ``output``; ``input`` is only read (and required) on root."""
        output = as_tensor(output, "output", "scatter", self.rank)
        slots = self._rooted_slots(output, "output", input, "input", root, "scatter")
        return self._finish(self._scatter(output, slots, root), async_op)

    def gather(
        self, input: Tensor, output: TensorOrList | None = None, root: int = 0, *, async_op: bool = False
    ) -> Work | None:
        """Rank i's ``input`` lands in root's slot i; ``output`` is only written (and required) on root."""
        input = as_tensor(input, "input", "gather", self.rank)
        slots = self._rooted_slots(input, "input", output, "output", root, "gather")
        return self._finish(self._gather(input, slots, root), async_op)

    def _rooted_slots(
        self,
        mine: torch.Tensor,
        mine_name: str,
        slots: TensorOrList | None,
        slots_name: str,
        root: int,
        op: str,
    ) -> list[torch.Tensor] | None:
        """Check a scatter's or gather's arguments: this rank's tensor, the root, and the root's slots
        (required on the root, ignored elsewhere); the root's normalised slots, None on the others."""
        mine = self._check(mine, mine_name, op)
        self._check_peer(root, "root", op)
        if self.rank != root:
            return None
        if slots is None:
            raise ValueError(f"[rank {self.rank} · {op}] the root must pass the {slots_name} tensors")
        normalised = self._slots(slots, slots_name, op)
        self._same_dtype([mine, *normalised], op)
        return normalised

    def barrier(self, *, async_op: bool = False) -> Work | None:
        return self._finish(self._barrier(), async_op)

    def split(self, ranks: Sequence[int]) -> Communicator | None:
        """A communicator over ``ranks`` (ordered; new rank = index in ``ranks``).

        Every rank of this group must call it with the same ``ranks``; ranks outside get ``None``. A
        group of one rank is the exception: its member may make it alone (no peer takes part).
        """
        ranks = list(ranks)
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(
                f"[rank {self.rank} · split] ranks {ranks} must be distinct members of "
                f"0..{self.world_size - 1}"
            )
        return self._split(ranks)

    def close(self) -> None:
        """Release transport resources; the default holds none of its own."""

    # ------------------------------------------------------------------ backend primitives
    @abstractmethod
    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Work: ...

    @abstractmethod
    def _irecv(self, tensor: torch.Tensor, src: int, tag: int) -> Work: ...

    @abstractmethod
    def _broadcast(self, tensor: torch.Tensor, root: int) -> Work: ...

    @abstractmethod
    def _reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp) -> Work: ...

    @abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work: ...

    def _all_reduce_into(self, source: torch.Tensor, output: torch.Tensor, op: ReduceOp) -> Work:
        """Out-of-place all_reduce. The default copies and reduces in place; a backend that can read
        ``source`` directly overrides it and saves a full pass over the buffer."""
        output.copy_(source)
        return self._all_reduce(output, op)

    @abstractmethod
    def _all_gather(self, outputs: list[torch.Tensor], input: torch.Tensor) -> Work: ...

    @abstractmethod
    def _reduce_scatter(self, output: torch.Tensor, inputs: list[torch.Tensor], op: ReduceOp) -> Work: ...

    @abstractmethod
    def _all_to_all(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> Work: ...

    @abstractmethod
    def _scatter(self, output: torch.Tensor, inputs: list[torch.Tensor] | None, root: int) -> Work: ...

    @abstractmethod
    def _gather(self, input: torch.Tensor, outputs: list[torch.Tensor] | None, root: int) -> Work: ...

    @abstractmethod
    def _barrier(self) -> Work: ...

    @abstractmethod
    def _split(self, ranks: list[int]) -> Communicator | None: ...
