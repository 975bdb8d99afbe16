"""``recomputed(fn, *inputs)``: run ``fn`` now, keep only its inputs, run it again when backward needs it.

Inside a recomputed region each tensor autograd saves for backward is replaced, as it is saved, by a
numbered ticket (a saved-tensor *pack* hook); the region's inputs are held instead. The first ticket
backward asks for (the *unpack* hook) runs ``fn`` again on the same inputs under the same random state
and autocast, collecting the fresh saved tensors in order; every ticket then resolves to its twin.

Why not an autograd Function that re-runs the forward in its backward: the graph of the first forward
stays the graph backward walks, so everything that hooks autograd sees no region — data parallelism's and
ZeRO's accumulation hooks and end-of-backward callbacks fire once, on the outer pass; sequence
parallelism's parameter hooks fire once; a split backward (zero-bubble pipelines) still finds a Linear's
output in the graph. Parameters are read, not saved, so ZeRO-3's gather before a unit's backward has them
present when the recomputation runs.

**Random state**: the CPU generator (and the CUDA one of the inputs' device), and every ``random``
attribute with ``get_state``/``set_state`` of a module under ``owners`` (tensor parallelism's per-rank
state), are captured before the first run and set for the second, then put back: the masks are identical
and the training's sequence of random numbers undisturbed.

**Side effects** (a mixture of experts' router tally, its last routing): modules under ``owners`` with a
boolean ``recomputing`` attribute have it True while their forward runs again, and skip what they already
did. Collectives in the recomputed forward (expert parallelism's all-to-alls) run again in their order at
the first ticket backward asks for; every rank walks the same graph, so they meet at the same point.
Saved-bytes measurement (:mod:`.saved`) sees the kept inputs through :func:`note_kept`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
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


def replay_aware(owners: Sequence[nn.Module]) -> list[nn.Module]:
    """The modules under ``owners`` that declare a ``recomputing`` flag (each once, in module order)."""
    found: dict[int, nn.Module] = {}
    for owner in owners:
        for module in owner.modules():
            if isinstance(getattr(module, "recomputing", None), bool):
                found.setdefault(id(module), module)
    return list(found.values())


class _Region:
    """One run of a recomputed function: its inputs, its states, and the tensors of its recomputation."""

    def __init__(self, fn: Callable[..., Any], inputs: Sequence[torch.Tensor], owners: Sequence[nn.Module]):
        self.fn = fn
        self.inputs = tuple(inputs)
        self.device = device = inputs[0].device
        # every random state the region may draw from, as it was when it first ran
        self.sources = random_sources(owners)
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.own = [source.get_state() for source in self.sources]
        kind = device.type  # the autocast the region ran under, entered again for the recomputation
        self.autocast = partial(
            torch.autocast,
            kind,
            dtype=torch.get_autocast_dtype(kind),
            enabled=torch.is_autocast_enabled(kind),
        )
        self.replay_aware = replay_aware(owners)
        self.saved = 0  # tickets handed out by the first run
        self.recomputed: list[torch.Tensor | None] = []

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """Inside: the captured random states, and ``recomputing`` True on the replay-aware modules.
        After: the states and flags from before entering, untouched by the replay."""
        own = [source.get_state() for source in self.sources]
        flags = [module.recomputing for module in self.replay_aware]
        with torch.random.fork_rng(devices=[self.device] if self.cuda is not None else []):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            for source, state in zip(self.sources, self.own, strict=True):
                source.set_state(state)
            for module in self.replay_aware:
                module.recomputing = True
            try:
                yield
            finally:
                for source, state in zip(self.sources, own, strict=True):
                    source.set_state(state)
                for module, flag in zip(self.replay_aware, flags, strict=True):
                    module.recomputing = flag

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
        with torch.enable_grad(), self.replaying(), self.autocast(), hooks:
            self.fn(*inputs)
        if len(fresh) != self.saved:
            raise RuntimeError(
                f"recomputation saved {len(fresh)} tensors for backward where the first run saved "
                f"{self.saved}: {getattr(self.fn, '__qualname__', self.fn)} must compute the same thing when "
                "run again"
            )
        self.recomputed = list(fresh)


def recomputed(fn: Callable[..., Any], *inputs: torch.Tensor, owners: Sequence[nn.Module] = ()) -> Any:
    """``fn(*inputs)``, keeping only ``inputs`` for backward and recomputing the rest when it is needed;
    ``owners``: the modules ``fn`` runs (module docstring). Without autograd simply ``fn(*inputs)``."""
    if not torch.is_grad_enabled():
        return fn(*inputs)
    region = _Region(fn, inputs, owners)
    note_kept(inputs)
    with torch.autograd.graph.saved_tensors_hooks(region.pack, region.unpack):
        return fn(*inputs)
