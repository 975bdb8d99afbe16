"""What autograd keeps for backward, measured: bytes per layer through saved-tensor hooks.

While a :class:`SavedBytes` records, every tensor saved for backward passes its pack hook and is counted
once per storage (q, k and v views of one projection output cost their memory once), parameters excluded
since they are held anyway; :meth:`SavedBytes.per_layer` attributes saves to the running layer, per call
(so per micro-batch). A recomputed region (:mod:`.region`) hides what it drops (its hooks are innermost)
and reports what it keeps through :func:`note_kept`, so a measurement is of what is really held.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn

_RECORDING: list[SavedBytes] = []


def note_kept(tensors: Iterable[torch.Tensor]) -> None:
    """Count ``tensors`` as saved for backward in every recording measurement (a region's kept inputs)."""
    for measurement in _RECORDING:
        for tensor in tensors:
            measurement.add(tensor)


class SavedBytes:
    """Bytes saved for backward, per scope and per call of that scope (see the module docstring)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {_storage_key(p) for p in exclude}
        self._scope: tuple[str, int] = ("total", 0)
        self._scope_excluded: set[int] = set()
        self._calls: dict[str, int] = {}
        self._storages: dict[tuple[str, int], dict[int, int]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}

    def add(self, tensor: torch.Tensor) -> None:
        key = _storage_key(tensor)
        if key in self._excluded or key in self._scope_excluded:
            return
        self._storages.setdefault(self._scope, {})[key] = tensor.untyped_storage().nbytes()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.add(tensor)
        return tensor

    @contextmanager
    def recording(self) -> Iterator[SavedBytes]:
        """Count what is saved inside the block."""
        _RECORDING.append(self)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unchanged):
                yield self
        finally:
            _RECORDING.remove(self)

    def per_layer(self, layers: Sequence[tuple[str, nn.Module]]) -> Any:
        """Attribute the saves inside each named layer's forward to it (one more call of it each time), its
        parameters excluded, through forward hooks; the returned handles remove them."""
        outer: list[tuple[tuple[str, int], set[int]]] = []

        def before(module: nn.Module, args: tuple[Any, ...], name: str) -> None:
            outer.append((self._scope, self._scope_excluded))
            call = self._calls.get(name, 0)
            self._calls[name] = call + 1
            self._scope = (name, call)
            self._scope_excluded = {_storage_key(p) for p in module.parameters()}
            if args and isinstance(args[0], torch.Tensor):
                self.shapes[name] = tuple(args[0].shape)

        def after(*_: Any) -> None:
            self._scope, self._scope_excluded = outer.pop()

        handles = []
        for name, layer in layers:
            handles += [
                layer.register_forward_pre_hook(partial(before, name=name)),
                layer.register_forward_hook(after),
            ]
        return _Handles(handles)

    def bytes_per_call(self) -> dict[str, float]:
        """Mean bytes saved per call of each scope (``total``: what no scope claimed)."""
        calls: dict[str, list[int]] = {}
        for (name, _call), storages in self._storages.items():
            calls.setdefault(name, []).append(sum(storages.values()))
        return {name: statistics.fmean(values) for name, values in calls.items()}


class _Handles:
    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _unchanged(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def saved_bytes(fn: Callable[..., Any], *inputs: Any) -> int:
    """Bytes of the tensors ``fn(*inputs)`` saves for backward (storages once; a module's parameters
    excluded)."""
    measurement = SavedBytes(exclude=fn.parameters() if isinstance(fn, nn.Module) else ())
    with measurement.recording():
        fn(*inputs)
    return int(sum(measurement.bytes_per_call().values()))
