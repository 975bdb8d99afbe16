"""Each rank's random streams in a checkpoint, so that a resumed run draws the dropout masks the
uninterrupted run would have drawn.

A rank draws from torch's CPU generator, its CUDA device's, and the generators modules keep of their own
(tensor parallelism's :class:`~meshwise.parallel.tensor_parallel.rng.RankRandomState`, found as
recomputation finds them). :func:`capture` takes them all as uint8 tensors, written into the DCP
checkpoint under ``rng.<rank key>`` — each rank its own entry, keyed by its mesh coordinates, so no rank
gathers another's — and :func:`restore` sets them back on the same coordinates.

**Another layout.** A stream belongs to one rank of one layout: after dp2 → dp4 there is no "dp3" stream,
and the surviving coordinates draw masks for other sequences (masks are drawn over *local* tensors, not
global token positions). Exactness across layouts with dropout is therefore impossible; what such a
resume gets is *determinism*: :func:`rederive` seeds every stream from ``(seed, step)`` — the default
generators alike on every rank, as ``--seed`` does (tensor parallelism needs the replicated activations'
masks equal), module streams from the coordinates too. A checkpoint without streams takes the same path.
Without dropout a step draws nothing, so a resume on any layout stays exact.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from meshwise.parallel.recompute.region import random_sources

CPU, CUDA = "cpu", "cuda"


def rank_key(coordinates: Mapping[str, int]) -> str:
    """The rank's place on the mesh as one checkpoint key: ``pp0.dp1.ep0.cp0.tp0``."""
    return ".".join(f"{axis}{index}" for axis, index in coordinates.items())


def capture(models: Sequence[nn.Module], device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's random streams now: CPU, CUDA (on a CUDA device) and each module stream under
    ``models`` (``module0``, ``module1``, … in module order, which the same layout builds alike)."""
    state = {CPU: torch.get_rng_state()}
    if device.type == "cuda":
        state[CUDA] = torch.cuda.get_rng_state(device)
    for index, source in enumerate(random_sources(models)):
        state[f"module{index}"] = source.get_state()
    return state


def restore(state: Mapping[str, torch.Tensor], models: Sequence[nn.Module], device: torch.device) -> None:
    """Set the streams :func:`capture` took (on the same coordinates of the same layout)."""
    sources = random_sources(models)
    if len(state) - 1 - (CUDA in state) != len(sources):
        raise ValueError(
            f"the checkpoint holds {len(state) - 1 - (CUDA in state)} module random streams for this "
            f"rank, but the model has {len(sources)}"
        )
    torch.set_rng_state(state[CPU])
    if device.type == "cuda" and CUDA in state:
        torch.cuda.set_rng_state(state[CUDA], device)
    for index, source in enumerate(sources):
        source.set_state(state[f"module{index}"])


def rederive(seed: int, step: int, coordinates: Mapping[str, int], models: Sequence[nn.Module]) -> None:
    """Seed every stream from ``(seed, step)`` (module streams also from the rank's coordinates): the
    deterministic continuation on another layout (see the module docstring)."""
    torch.manual_seed(derived_seed(seed, step))  # CPU and every CUDA device
    key = rank_key(coordinates)
    for index, source in enumerate(random_sources(models)):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derived_seed(seed, step, f"{key}/module{index}"))
            source.set_state(torch.get_rng_state())


def derived_seed(seed: int, step: int, stream: str = "") -> int:
    """A 63-bit seed that is a pure function of its arguments (no Python hash randomisation)."""
    digest = hashlib.sha256(f"meshwise/{seed}/{step}/{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
