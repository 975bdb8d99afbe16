"""``recomputed(fn, *inputs)``: run ``fn`` now, keep only its inputs, run it again when backward needs it.

Autograd normally keeps every tensor an operation saves for its backward (a matmul's input, a softmax's
output) until that backward has run. Inside a recomputed region those tensors are dropped as they are
saved — a saved-tensor *pack* hook hands autograd a numbered ticket instead — and the region's inputs are
held instead. The first time backward asks for one of the tickets (the *unpack* hook), ``fn`` is run once
more on the same inputs under the same random state and autocast, with a pack hook that collects the
fresh saved tensors in order; every ticket of the region then resolves to its twin.

Why this shape rather than an autograd Function that re-runs the forward inside its backward:

- the graph built by the first forward stays the graph backward walks, so the region is invisible to
  everything that hooks autograd — gradient-accumulation hooks of data parallelism and ZeRO fire once, in
  the outer backward, with their end-of-backward callbacks queued on the outer pass; tensor hooks on
  parameters (sequence parallelism's gradient sums) fire once; a split backward that asks for the
  gradient of a Linear's output (zero-bubble pipelines) still finds that output in the graph;
- parameters need no special treatment: they are read, not saved, so ZeRO-3's gather before a unit's
  backward makes them present when the recomputation runs.

**Random state** (dropout): the CPU generator (and the CUDA one of the inputs' device) is captured before
the first run and set for the second, then put back, so masks are identical and the training sequence of
random numbers is not disturbed. Modules may draw from states of their own (tensor parallelism's
per-rank state): any ``random`` attribute of a module in ``owners`` with ``get_state``/``set_state`` is
captured and replayed the same way.

**Side effects** (a mixture of experts' router tally, its last routing for the auxiliary losses): the
recomputation must not repeat them. Any module under ``owners`` with a boolean ``recomputing`` attribute
has it set to True while its forward runs again (:func:`recomputing`), and skips what it already did;
the auxiliary losses need nothing more — the first run's graph, which backward walks, holds them once.
Collectives in the recomputed forward (expert parallelism's all-to-alls) run again in their order, at
the first ticket backward asks for; every rank walks the same graph, so they meet at the same point.

Saved-bytes measurement (:mod:`.saved`) sees the region's kept inputs through :func:`note_kept`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn

from meshwise.parallel.recompute.saved import note_kept


class RandomSource(Protocol):
    """A random state a module draws from besides torch's global generators."""

    def get_state(self) -> torch.Tensor: ...

    def set_state(self, state: torch.Tensor) -> None: ...


def random_sources(owners: Sequence[nn.Module]) -> list[RandomSource]:
    """The distinct ``random`` states of the modules under ``owners`` (each once, in module order)."""
    found: dict[int, RandomSource] = {}
    for owner in owners:
        for module in owner.modules():
            source = getattr(module, "random", None)
            if source is not None and hasattr(source, "get_state") and hasattr(source, "set_state"):
                found.setdefault(id(source), source)
    return list(found.values())


class RandomSnapshot:
    """Every random state a region may draw from, as it was when the region first ran."""

    def __init__(self, device: torch.device, sources: Sequence[RandomSource]) -> None:
        self.device = device
        self.sources = list(sources)
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.own = [source.get_state() for source in self.sources]

    @contextmanager
    def replayed(self) -> Iterator[None]:
        """Inside: the captured states. After: the states from before entering, untouched by the replay."""
        cpu, own = torch.get_rng_state(), [source.get_state() for source in self.sources]
        cuda = torch.cuda.get_rng_state(self.device) if self.cuda is not None else None
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
        for source, state in zip(self.sources, self.own, strict=True):
            source.set_state(state)
        try:
            yield
        finally:
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, self.device)
            for source, state in zip(self.sources, own, strict=True):
                source.set_state(state)


def replay_aware(owners: Sequence[nn.Module]) -> list[nn.Module]:
    """The modules under ``owners`` that declare a ``recomputing`` flag (each once, in module order)."""
    found: dict[int, nn.Module] = {}
    for owner in owners:
        for module in owner.modules():
            if isinstance(getattr(module, "recomputing", None), bool):
                found.setdefault(id(module), module)
    return list(found.values())


@contextmanager
def recomputing(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Inside: every one of ``modules`` has ``recomputing = True``; after: the values from before."""
    before = [module.recomputing for module in modules]
    for module in modules:
        module.recomputing = True
    try:
        yield
    finally:
        for module, value in zip(modules, before, strict=True):
            module.recomputing = value


class AutocastSnapshot:
    """The autocast setting of the device a region ran on, re-entered for the recomputation."""

    def __init__(self, device: torch.device) -> None:
        self.device_type = device.type
        self.enabled = torch.is_autocast_enabled(self.device_type)
        self.dtype = torch.get_autocast_dtype(self.device_type)

    def entered(self) -> torch.autocast:
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)


class _Region:
    """One run of a recomputed function: its inputs, its states, and the tensors of its recomputation."""

    def __init__(self, fn: Callable[..., Any], inputs: Sequence[torch.Tensor], owners: Sequence[nn.Module]):
        self.fn = fn
        self.inputs = tuple(inputs)
        device = inputs[0].device
        self.random = RandomSnapshot(device, random_sources(owners))
        self.autocast = AutocastSnapshot(device)
        self.replay_aware = replay_aware(owners)
        self.saved = 0  # tickets handed out by the first run
        self.recomputed: list[torch.Tensor | None] = []

    def pack(self, _tensor: torch.Tensor) -> int:
        self.saved += 1
        return self.saved - 1

    def unpack(self, ticket: int) -> torch.Tensor:
        if not self.recomputed or self.recomputed[ticket] is None:  # first use (or a retained graph's next)
            self.recompute()
        tensor = self.recomputed[ticket]
        self.recomputed[ticket] = None  # each ticket is read once per backward: free it as it goes
        assert tensor is not None
        return tensor

    def recompute(self) -> None:
        fresh: list[torch.Tensor] = []

        def collect(tensor: torch.Tensor) -> int:
            # detached, as torch.utils.checkpoint keeps them: the tensor's own grad_fn belongs to this
            # throw-away graph, whose saved-tensor hooks hold ``fresh`` — a cycle through C++ that the
            # garbage collector cannot see, which kept every recomputed tensor to the end of backward
            fresh.append(tensor.detach())
            return len(fresh) - 1

        inputs = [x.detach().requires_grad_(x.requires_grad) for x in self.inputs]
        hooks = torch.autograd.graph.saved_tensors_hooks(collect, fresh.__getitem__)
        replaying = recomputing(self.replay_aware)
        with torch.enable_grad(), self.random.replayed(), self.autocast.entered(), replaying, hooks:
            self.fn(*inputs)
        if len(fresh) != self.saved:
            raise RuntimeError(
                f"recomputation saved {len(fresh)} tensors for backward where the first run saved "
                f"{self.saved}: "
                f"{getattr(self.fn, '__qualname__', self.fn)} must compute the same thing when run again"
            )
        self.recomputed = list(fresh)


def recomputed(fn: Callable[..., Any], *inputs: torch.Tensor, owners: Sequence[nn.Module] = ()) -> Any:
    """``fn(*inputs)``, keeping only ``inputs`` for backward and recomputing the rest when it is needed.

    ``owners`` are the modules ``fn`` runs (their own random states are replayed, their ``recomputing``
    flags set during the second run). Without autograd
    (evaluation, ``torch.no_grad``) it is simply ``fn(*inputs)``.
    """
    if not torch.is_grad_enabled():
        return fn(*inputs)
    region = _Region(fn, inputs, owners)
    note_kept(inputs)
    with torch.autograd.graph.saved_tensors_hooks(region.pack, region.unpack):
        return fn(*inputs)
