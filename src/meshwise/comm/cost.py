"""The α-β-γ cost model of collectives, its calibration, and the choice ``algo="auto"`` makes.

A message of n bytes over one link costs α + n·β (α: latency per message, β: seconds per byte) and
reducing n bytes costs n·γ. Each (collective, algorithm) pair is a linear form a·α + b·β + c·γ whose
coefficients depend only on n and the world size p — the classic formulas of Thakur, Rabenseifner &
Gropp (2005), e.g. ring all-reduce 2(p−1)α + 2(p−1)/p·nβ + (p−1)/p·nγ, recursive doubling
lg p·(α + nβ + nγ), Rabenseifner 2·lg p·α + 2(p−1)/p·nβ + (p−1)/p·nγ, binomial broadcast lg p·(α + nβ).
Sizes: n is the full vector for all_reduce/reduce/broadcast, all slots together for all_gather,
reduce_scatter, scatter and gather, and one rank's whole input for all_to_all.

Two more terms describe ranks that share cores. In an *exchange step* every rank both sends and
receives (ring, recursive doubling and halving, pairwise), so all ranks must run at once; when there are
more ranks than cores each such step waits for a scheduling round (σ per step) and both directions
share the cores (δ per byte moved in such steps). Tree steps are one-way and pay neither, which is why
the binomial tree beats recursive doubling on 4 ranks over 2 cores although it takes twice the steps.
Where every rank has a core of its own the fit leaves σ = δ = 0 and the classic model remains.

Everything here is a pure function of its inputs so that the planner can evaluate hypothetical
machines. Three links are calibrated: ``intra`` (our algorithms between ranks of one node), ``inter``
(between nodes) and ``native`` (the backend's own collectives, so ``auto`` only replaces them where an
algorithm of ours is predicted to be faster). ``intra`` and ``native`` may also be calibrated per world
size (:meth:`Calibration.for_world`): on a machine whose ranks share cores, α grows with the number of
ranks, so one set of parameters cannot describe both 2 and 4 ranks.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

COLLECTIVES = (
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "reduce",
    "scatter",
    "gather",
    "all_to_all",
)

#: Which collectives each algorithm implements; the others fall back to the backend's own (native) op.
COVERAGE: dict[str, tuple[str, ...]] = {
    "native": COLLECTIVES,
    "ring": ("all_reduce", "reduce_scatter", "all_gather"),
    "tree": ("all_reduce", "broadcast", "reduce", "scatter", "gather"),
    "rd": ("all_reduce", "all_gather"),
    "rhd": ("all_reduce", "reduce_scatter"),
    "pairwise": ("all_to_all",),
    "linear": COLLECTIVES,
    "hierarchical": ("all_reduce",),
}

#: The algorithm each backend-native collective behaves like (gloo and NCCL: rings for the bulk ones).
NATIVE_SHAPE = {
    "all_reduce": "ring",
    "reduce_scatter": "ring",
    "all_gather": "ring",
    "broadcast": "tree",
    "reduce": "tree",
    "scatter": "linear",
    "gather": "linear",
    "all_to_all": "pairwise",
}


@dataclass(frozen=True)
class LinkParams:
    """α (s per message), β (s per byte moved), γ (s per byte reduced), and the oversubscription terms:
    σ (s per exchange step) and δ (s per byte moved in exchange steps); see the module docstring."""

    alpha: float
    beta: float
    gamma: float
    sigma: float = 0.0
    delta: float = 0.0

    def __post_init__(self) -> None:
        for name in PARAMETERS:
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"LinkParams.{name} must be a finite non-negative number, got {value!r}")


#: the fields of :class:`LinkParams`, in the order of :func:`coefficients`
PARAMETERS = ("alpha", "beta", "gamma", "sigma", "delta")


@dataclass(frozen=True)
class CostSample:
    """One measurement: ``seconds`` for ``collective`` with ``algo`` on ``nbytes`` over ``world_size``."""

    collective: str
    algo: str
    nbytes: int
    world_size: int
    seconds: float


# Built-in defaults, from `benchmarks/bench_algorithms.py -np 2,4` on the 2-core development box (gloo over
# loopback, heavily shared): each point-to-point step of our plans cost 1–4 ms there (Python executor and
# gloo's per-message handshake) against ~0.2 ms per step inside gloo's own collectives, and our large
# messages reached ~0.5–0.8x of gloo's ring bandwidth. With these numbers ``auto`` keeps the native
# collective on such a machine; ``meshwise bench --calibrate`` replaces them with the user's measurements.
_DEFAULT_INTRA = LinkParams(alpha=1.5e-3, beta=1.0e-9, gamma=5.0e-10)
_DEFAULT_INTER = LinkParams(alpha=1.5e-3, beta=1.0e-9, gamma=5.0e-10)
_DEFAULT_NATIVE = LinkParams(alpha=2.0e-4, beta=4.0e-10, gamma=4.0e-10)

DEFAULT_PATH = Path("~/.cache/meshwise/calibration.json")

#: how much faster than ``native`` one of our algorithms must be predicted before ``auto`` takes it: above
#: the calibrated model's typical error (median factor 1.20 out of sample, benchmarks/RESULTS.md), so a
#: switch is not a coin toss, yet low enough to take the 1.3-1.6x wins of recursive doubling at 2 ranks
SWITCH_MARGIN = 1.25


@dataclass(frozen=True)
class WorldLinks:
    """The links measured in a job of one world size: α in particular depends on how many ranks share the
    cores, so these override the top-level values for that size. ``inter`` stays global."""

    intra: LinkParams
    native: LinkParams


@dataclass(frozen=True)
class Calibration:
    """Link parameters of one machine: within a node, between nodes, and the backend's own collectives.

    The top-level links are the default (the latest fit, or a joint fit over world sizes);
    ``by_world_size`` holds (world size, links) pairs measured at that size, sorted and unique. It is a
    tuple rather than a dict so that a calibration stays hashable (``auto`` caches its choices by it).
    """

    intra: LinkParams
    inter: LinkParams
    native: LinkParams = _DEFAULT_NATIVE
    by_world_size: tuple[tuple[int, WorldLinks], ...] = ()

    def __post_init__(self) -> None:
        entries = dict(self.by_world_size)
        if len(entries) != len(self.by_world_size) or any(p < 1 for p in entries):
            raise ValueError(f"by_world_size needs unique world sizes >= 1, got {sorted(entries)}")
        object.__setattr__(self, "by_world_size", tuple(sorted(entries.items())))

    @classmethod
    def default(cls) -> Calibration:
        return cls(_DEFAULT_INTRA, _DEFAULT_INTER, _DEFAULT_NATIVE)

    def with_world(self, world_size: int, links: WorldLinks) -> Calibration:
        """This calibration with the entry for ``world_size`` set to ``links`` (the others kept), so that
        calibrating one world size after another accumulates them."""
        entries = {**dict(self.by_world_size), world_size: links}
        return Calibration(self.intra, self.inter, self.native, tuple(entries.items()))

    def for_world(self, world_size: int) -> Calibration:
        """The links to price a job of ``world_size`` ranks with: the entry measured at that size, else the
        nearest measured size (by |log2 ratio|, ties to the larger, which errs towards more contention),
        else the top-level values. The result has no per-world entries of its own."""
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        flat = Calibration(self.intra, self.inter, self.native)
        if not self.by_world_size:
            return flat
        _, links = min(
            self.by_world_size, key=lambda entry: (abs(math.log2(entry[0] / world_size)), -entry[0])
        )
        return Calibration(links.intra, self.inter, links.native)

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> Calibration:
        """Read ``path`` (default ``~/.cache/meshwise/calibration.json``); built-in defaults when the
        default file does not exist. An explicit path must exist."""
        file = Path(path).expanduser() if path is not None else DEFAULT_PATH.expanduser()
        if not file.exists():
            if path is not None:
                raise FileNotFoundError(
                    f"calibration file {file} does not exist; run `meshwise bench --calibrate`"
                )
            return cls.default()
        try:
            return _from_json(json.loads(file.read_text()))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"calibration file {file} is malformed ({exc}); it needs 'intra' (and optionally 'inter', "
                "'native') objects with alpha, beta, gamma, and optionally 'by_world_size' mapping world "
                "sizes to 'intra' and 'native' objects — re-run `meshwise bench --calibrate` or delete it"
            ) from exc

    def save(self, path: str | os.PathLike[str] | None = None) -> Path:
        file = Path(path).expanduser() if path is not None else DEFAULT_PATH.expanduser()
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps(_to_json(self), indent=2) + "\n")
        return file


def _to_json(calibration: Calibration) -> dict[str, object]:
    """The file's layout: top-level links, plus ``by_world_size`` keyed by the world size as a string
    (JSON keys are strings) only when there are entries, so files without them keep their old form."""
    raw: dict[str, object] = {
        name: asdict(getattr(calibration, name)) for name in ("intra", "inter", "native")
    }
    if calibration.by_world_size:
        raw["by_world_size"] = {str(p): asdict(links) for p, links in calibration.by_world_size}
    return raw


def _from_json(raw: object) -> Calibration:
    """Inverse of :func:`_to_json`; KeyError, TypeError or ValueError on anything else (load explains)."""
    if not isinstance(raw, Mapping):
        raise TypeError(f"expected a JSON object, got {type(raw).__name__}")
    intra = _link(raw["intra"])
    inter = _link(raw["inter"]) if "inter" in raw else intra
    native = _link(raw["native"]) if "native" in raw else _DEFAULT_NATIVE
    entries = raw.get("by_world_size", {})
    if not isinstance(entries, Mapping):
        raise TypeError(f"'by_world_size' must be an object, got {type(entries).__name__}")
    by_world = []
    for key, value in entries.items():
        if not isinstance(value, Mapping):
            raise TypeError(f"by_world_size[{key!r}] must be an object, got {type(value).__name__}")
        by_world.append((int(key), WorldLinks(_link(value["intra"]), _link(value["native"]))))
    return Calibration(intra, inter, native, tuple(by_world))


def _link(raw: object) -> LinkParams:
    if not isinstance(raw, Mapping):
        raise TypeError(f"a link must be an object with alpha, beta, gamma, got {raw!r}")
    return LinkParams(**raw)


def _lg(p: int) -> int:
    return max(p - 1, 0).bit_length()


Coefficients = tuple[float, float, float, float, float]


def coefficients(collective: str, algo: str, nbytes: float, world_size: int) -> Coefficients:
    """(a, b, c, s, d) with time = a·α + b·β + c·γ + s·σ + d·δ for a single-link algorithm: a messages
    on the busiest rank, b bytes moved, c bytes reduced, s exchange steps (every rank sends and receives)
    and d bytes moved in them. ``native`` uses the shape of the backend's own algorithm
    (:data:`NATIVE_SHAPE`)."""
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; choose one of {COLLECTIVES}")
    if algo == "native":
        algo = NATIVE_SHAPE[collective]
    if algo not in COVERAGE or collective not in COVERAGE[algo] or algo == "hierarchical":
        raise ValueError(f"no single-link cost for {collective} with algo {algo!r}")
    p, n = world_size, float(nbytes)
    if p == 1:
        return (0.0, 0.0, 0.0, 0.0, 0.0)
    frac = (p - 1) / p
    lg, p2 = _lg(p), 1 << (p.bit_length() - 1)
    fold = 0 if p == p2 else 1  # non-power-of-two: fold-in and fold-out steps
    lg2 = p2.bit_length() - 1
    halving = (p2 - 1) / p2 * n  # bytes one rank moves while recursive halving among p2 ranks
    # (a, b, c) of the classic model, then (s, d): exchange steps and the bytes moved in them; rooted
    # (tree, linear broadcast/reduce/scatter/gather) steps are one-way, and fold steps of the
    # non-power-of-two paths are one-way too
    table: dict[tuple[str, str], Coefficients] = {
        ("all_reduce", "ring"): (2 * (p - 1), 2 * frac * n, frac * n, 2 * (p - 1), 2 * frac * n),
        ("all_reduce", "rd"): (lg2 + 2 * fold, n * (lg2 + 2 * fold), n * (lg2 + fold), lg2, lg2 * n),
        ("all_reduce", "rhd"): (
            2 * lg2 + 2 * fold,
            2 * halving + 2 * fold * n,
            halving + fold * n,
            2 * lg2,
            2 * halving,
        ),
        ("all_reduce", "tree"): (2 * lg, 2 * lg * n, lg * n, 0.0, 0.0),
        ("all_reduce", "linear"): (p - 1, (p - 1) * n, (p - 1) * n, 1.0, (p - 1) * n),
        ("reduce_scatter", "ring"): (p - 1, frac * n, frac * n, p - 1, frac * n),
        ("reduce_scatter", "rhd"): (
            lg2 + 2 * fold,
            halving + fold * n * (1 + 1 / p),
            halving + fold * n,
            lg2,
            halving,
        ),
        ("reduce_scatter", "linear"): (p - 1, frac * n, frac * n, 1.0, frac * n),
        ("all_gather", "ring"): (p - 1, frac * n, 0.0, p - 1, frac * n),
        ("all_gather", "rd"): (lg2 + 2 * fold, frac * n + fold * n, 0.0, lg2, frac * n),
        ("all_gather", "linear"): (p - 1, frac * n, 0.0, 1.0, frac * n),
        ("broadcast", "tree"): (lg, lg * n, 0.0, 0.0, 0.0),
        ("broadcast", "linear"): (p - 1, (p - 1) * n, 0.0, 0.0, 0.0),
        ("reduce", "tree"): (lg, lg * n, lg * n, 0.0, 0.0),
        ("reduce", "linear"): (p - 1, (p - 1) * n, (p - 1) * n, 0.0, 0.0),
        ("scatter", "tree"): (2 * lg, frac * n, 0.0, 0.0, 0.0),  # sizes travel first (uneven slots)
        ("scatter", "linear"): (p - 1, frac * n, 0.0, 0.0, 0.0),
        ("gather", "tree"): (2 * lg, frac * n, 0.0, 0.0, 0.0),
        ("gather", "linear"): (p - 1, frac * n, 0.0, 0.0, 0.0),
        ("all_to_all", "pairwise"): (p - 1, frac * n, 0.0, p - 1, frac * n),
        ("all_to_all", "linear"): (p - 1, frac * n, 0.0, 1.0, frac * n),
    }
    return table[(collective, algo)]


def predict_seconds(
    collective: str,
    algo: str,
    nbytes: float,
    world_size: int,
    link: LinkParams,
    *,
    inter: LinkParams | None = None,
    local_size: int | None = None,
) -> float:
    """Predicted time of one call. ``hierarchical`` also needs ``inter`` and ``local_size`` (ranks per
    node): intra-node ring reduce-scatter, inter-node all-reduce of n/L bytes, intra-node ring all-gather."""
    if algo == "hierarchical":
        if collective != "all_reduce" or inter is None or local_size is None:
            raise ValueError("hierarchical cost is defined for all_reduce and needs inter= and local_size=")
        if local_size < 1 or world_size % local_size:
            raise ValueError(f"local_size {local_size} must divide the world size {world_size}")
        nodes = world_size // local_size
        intra = predict_seconds("reduce_scatter", "ring", nbytes, local_size, link)
        intra += predict_seconds("all_gather", "ring", nbytes, local_size, link)
        shard = nbytes / local_size
        across = min(predict_seconds("all_reduce", a, shard, nodes, inter) for a in ("ring", "rhd"))
        return intra + across
    terms = coefficients(collective, algo, nbytes, world_size)
    return sum(k * getattr(link, name) for k, name in zip(terms, PARAMETERS, strict=True))


def choose_algorithm(
    collective: str,
    nbytes: float,
    world_size: int,
    calibration: Calibration,
    *,
    local_size: int | None = None,
    candidates: Iterable[str] | None = None,
    margin: float = SWITCH_MARGIN,
) -> str:
    """The predicted-fastest algorithm for ``collective``; ``native`` stays unless beaten by ``margin``.

    The backend's own collective is the safe choice (tuned, one call, no Python executor), and a
    predicted win smaller than the model's typical error is no win: one of ours replaces ``native`` only
    when predicted ``margin`` times faster (:data:`SWITCH_MARGIN`).

    ``native`` is priced on the ``native`` link, measured over the whole job. With ``local_size`` (ranks
    per node) smaller than the world, our flat algorithms are priced on the inter-node link and
    ``hierarchical`` competes for all_reduce; on one node they use the ``intra`` link. Links come from
    ``calibration.for_world(world_size)``, the entry measured nearest this world size.
    """
    calibration = calibration.for_world(world_size)
    multi_node = local_size is not None and 1 <= local_size < world_size
    names = list(candidates) if candidates is not None else list(COVERAGE)
    best, best_time = "native", math.inf
    for algo in ["native", *[a for a in names if a != "native"]]:
        if collective not in COVERAGE.get(algo, ()):
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


#: worst-factor improvements below this are ties, won by the subset with fewer parameters
_TIE = 1e-6


def fit_link_params(samples: Sequence[CostSample]) -> tuple[LinkParams, float]:
    """Least-squares α, β, γ, σ, δ (non-negative) on relative residuals, judged by the worst factor.

    Returns the parameters and the model's error: the worst factor between predicted and measured time,
    minus one (0 is a perfect fit; 1 means some point is off by 2x, either way). Relative rather than
    absolute residuals keep the microsecond-scale small messages from being ignored next to the large
    ones. Every subset of the parameters is tried (non-negativity is exact), fewest parameters first, and
    the subset with the smallest worst factor wins; a larger subset must be strictly better, so what the
    samples cannot tell apart (σ from α when every sample is a ring) and what they do not need (σ, δ
    when every rank has a core) stays zero. The worst factor rather than |predicted − measured| /
    measured, because the latter never exceeds 1 for an under-prediction and so favours fits that
    predict almost nothing.
    """
    if len(samples) < 3:
        raise ValueError(f"fitting the link parameters needs at least 3 samples, got {len(samples)}")
    rows, times = [], []
    for s in samples:
        if s.seconds <= 0:
            raise ValueError(f"sample {s} has a non-positive time")
        rows.append(coefficients(s.collective, s.algo, s.nbytes, s.world_size))
        times.append(s.seconds)
    a = np.asarray(rows, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    weighted = a / t[:, None]
    scale = np.maximum(np.abs(weighted).max(axis=0), 1e-300)  # column scaling: α and β differ by 1e5
    width = len(PARAMETERS)
    best: tuple[float, np.ndarray] | None = None
    for size in range(1, width + 1):  # fewest parameters first: a larger subset must fit strictly better
        for cols in itertools.combinations(range(width), size):
            idx = list(cols)
            sol, *_ = np.linalg.lstsq(weighted[:, idx] / scale[idx], np.ones(len(t)), rcond=None)
            if np.any(sol < 0):
                continue
            x = np.zeros(width)
            x[idx] = sol / scale[idx]
            predicted = a @ x
            if np.any(predicted <= 0):
                continue  # a zero prediction is an infinite factor
            err = float(np.max(np.maximum(predicted / t, t / predicted))) - 1.0
            if best is None or err < best[0] - _TIE:
                best = (err, x)
    if best is None:
        raise ValueError("no non-negative α, β, γ, σ, δ predicts a positive time for every sample")
    err, x = best
    return LinkParams(*(float(v) for v in x)), err
