"""What ``algo="auto"`` picks: the registry's algorithm predicted fastest, unless native is close enough.

The backend's own collective is the safe choice (tuned, one call, no Python executor), and a predicted
win smaller than the model's typical error is no win, so one of ours replaces ``native`` only when it is
predicted :data:`SWITCH_MARGIN` times faster. The prices come from an explicit
:class:`~meshwise.comm.cost.calibration.Calibration`; nothing here reads a file.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

from meshwise.comm.algorithms.registry import REGISTRY, covers, predict_seconds
from meshwise.comm.cost.calibration import Calibration

#: how much faster than ``native`` one of our algorithms must be predicted before ``auto`` takes it: above
#: the calibrated model's typical error (median factor 1.20 out of sample, benchmarks/RESULTS.md), so a
#: switch is not a coin toss, yet low enough to take the 1.3-1.6x wins of recursive doubling at 2 ranks
SWITCH_MARGIN = 1.25


def choose_algorithm(
    collective: str,
    nbytes: float,
    world_size: int,
    calibration: Calibration,
    *,
    local_size: int | None = None,
    candidates: Iterable[str] | None = None,
    margin: float = SWITCH_MARGIN,
    switch: float = 0.0,
) -> str:
    """The predicted-fastest algorithm for ``collective``; ``native`` stays unless beaten by ``margin``.

    ``native`` is priced on the ``native`` link, measured over the whole job. With ``local_size`` (ranks
    per node) smaller than the world, our flat algorithms are priced on the inter-node link and
    ``hierarchical`` competes for all_reduce; on one node they use the ``intra`` link. Links come from
    ``calibration.for_world(world_size)``, the entry measured nearest this world size. ``switch``: the
    hierarchy's hand-over time between its levels (:attr:`~meshwise.comm.cost.calibration.Levels.switch`).
    """
    calibration = calibration.for_world(world_size)
    multi_node = local_size is not None and 1 <= local_size < world_size
    names = list(candidates) if candidates is not None else list(REGISTRY)
    best, best_time = "native", math.inf
    for algo in ["native", *[a for a in names if a != "native"]]:
        if not covers(algo, collective):
            continue
        if algo == "hierarchical":
            if not multi_node or local_size == 1:
                continue
            seconds = predict_seconds(
                collective,
                algo,
                nbytes,
                world_size,
                calibration.intra,
                inter=calibration.inter,
                local_size=local_size,
                switch=switch,
            )
        else:
            # native is calibrated over the whole job (across nodes too); our flat algorithms are priced
            # on their slowest link
            link = (
                calibration.native
                if algo == "native"
                else (calibration.inter if multi_node else calibration.intra)
            )
            seconds = predict_seconds(collective, algo, nbytes, world_size, link)
        if algo == "native":
            seconds /= margin
        if seconds < best_time:
            best, best_time = algo, seconds
    return best


#: ``auto`` asks the same few questions on every step of a training loop: remember the answers
cached_choice = functools.lru_cache(maxsize=4096)(choose_algorithm)


def choose_level_split(
    collective: str, nbytes: float, world_size: int, local_size: int, calibration: Calibration
) -> str:
    """What the two-level communicator (:mod:`meshwise.comm.two_level`) runs: ``native`` (its flat
    collective over every rank) or ``hierarchical`` (inside nodes, then across), priced with
    ``calibration``'s two-level links and no margin, since both are the transports' own collectives."""
    return choose_algorithm(
        collective,
        nbytes,
        world_size,
        calibration.two_level(),
        local_size=local_size,
        candidates=("hierarchical",),
        margin=1.0,
        switch=calibration.level_switch(),
    )


#: the two-level communicator asks on every call too
cached_level_split = functools.lru_cache(maxsize=4096)(choose_level_split)
