"""Fitting a link's parameters to measured times (what ``meshwise bench --calibrate`` does with them)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import numpy as np

from meshwise.comm.algorithms.registry import coefficients
from meshwise.comm.cost.calibration import CostSample
from meshwise.comm.cost.formulas import PARAMETERS, LinkParams

#: worst-factor improvements below this are ties, won by the subset with fewer parameters
_TIE = 1e-6


def fit_link_params(samples: Sequence[CostSample], *, burst: bool = False) -> tuple[LinkParams, float]:
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

    With ``burst`` the link may be a token bucket (:attr:`LinkParams.burst`): time = … + β·max(0, b − B).
    For each way of splitting the samples by their β coefficient b into those under the credit B and
    those over it (at least three over), that is linear in α, β, γ, σ, δ and κ = β·B (the over samples
    get b·β − κ, the under ones no β term), so the same non-negative subsets are solved with κ as one
    more column next to β; each solution is judged, like the rest, by the worst factor of the real
    max(0, b − B) model with B = κ/β, and a credit must fit strictly better than none. Only links that
    cross a network are fitted so; memory has no bucket.
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
    best = _best_subset(a, t, lambda x: a @ x)  # no credit
    if burst:
        moved = a[:, 1]
        for threshold in np.unique(moved):
            over = moved > threshold
            if np.count_nonzero(over) < 3:
                continue
            split = np.column_stack([a, -over.astype(np.float64)])
            split[:, 1] *= over  # the under samples pay no β
            # β is required: a credit on a link without a per-byte cost means nothing
            found = _best_subset(split, t, lambda x: _predict(_bucket(x), a), required=1)
            if found is not None and (best is None or found[0] < best[0] - _TIE):
                best = found
    if best is None:
        raise ValueError("no non-negative α, β, γ, σ, δ predicts a positive time for every sample")
    err, x = best
    return _bucket(x), err


def _bucket(x: np.ndarray) -> LinkParams:
    """The link of a solution vector: α, β, γ, σ, δ, and κ = β·credit where a sixth entry is given."""
    credit = float(x[5] / x[1]) if len(x) > 5 and x[1] > 0 else 0.0
    return LinkParams(*(float(v) for v in x[:5]), burst=credit)


def _predict(link: LinkParams, a: np.ndarray) -> np.ndarray:
    """``link``'s time for every row of coefficients ``a`` (:meth:`LinkParams.seconds`, vectorised)."""
    over = np.maximum(0.0, a[:, 1] - link.burst)
    return (
        a[:, 0] * link.alpha
        + over * link.beta
        + a[:, 2] * link.gamma
        + a[:, 3] * link.sigma
        + a[:, 4] * link.delta
    )


def _best_subset(
    a: np.ndarray,
    t: np.ndarray,
    predict: Callable[[np.ndarray], np.ndarray],
    required: int | None = None,
) -> tuple[float, np.ndarray] | None:
    """The non-negative least-squares solution of a·x ≈ t (relative residuals) over the subset of the
    parameter columns with the smallest worst factor of ``predict(x)`` against t, and that factor − 1.
    Fewest columns first, a larger subset must be strictly better. Columns of ``a`` beyond the parameters
    are in every subset; the ``required`` parameter column too."""
    weighted = a / t[:, None]
    scale = np.maximum(np.abs(weighted).max(axis=0), 1e-300)  # column scaling: α and β differ by 1e5
    width = len(PARAMETERS)
    best: tuple[float, np.ndarray] | None = None
    for size in range(1, width + 1):  # fewest parameters first: a larger subset must fit strictly better
        for cols in itertools.combinations(range(width), size):
            if required is not None and required not in cols:
                continue
            idx = [*cols, *range(width, a.shape[1])]
            sol, *_ = np.linalg.lstsq(weighted[:, idx] / scale[idx], np.ones(len(t)), rcond=None)
            if np.any(sol < 0):
                continue
            x = np.zeros(a.shape[1])
            x[idx] = sol / scale[idx]
            predicted = predict(x)
            if np.any(predicted <= 0):
                continue  # a zero prediction is an infinite factor
            err = float(np.max(np.maximum(predicted / t, t / predicted))) - 1.0
            if best is None or err < best[0] - _TIE:
                best = (err, x)
    return best


#: the largest size must take at least this many times the smallest's time, or β is noise
IDENTIFIABLE = 1.5


def fit_call_cost(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """(α, β) of one collective call on a fixed group, ``seconds ≈ α + β·bytes``, from measured sizes.

    The planner prices each call it counts with the link measured *for that collective on that many
    endpoints*, so the per-call form is all it needs (the algorithm gloo runs inside is what was timed).
    Least squares on relative residuals (a 64 KiB call weighs as much as a 32 MiB one), non-negative: an
    unconstrained negative α is refitted as β alone. β is never clamped: where the sizes do not tell it
    from noise (the largest call not :data:`IDENTIFIABLE` × slower than the smallest) or the fit gives
    β ≤ 0, this raises ValueError saying so — a silent clamp is what priced gradients at ~0 before.
    """
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"fitting α and β needs at least 2 (size, seconds) pairs, got {len(sizes)}")
    n = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if np.any(t <= 0) or np.any(n < 0):
        raise ValueError("every measured call needs a positive time and a non-negative size")
    smallest, largest = int(np.argmin(n)), int(np.argmax(n))
    if t[largest] < IDENTIFIABLE * t[smallest]:
        raise ValueError(
            f"β is not identifiable: {n[largest]:.0f} bytes took {t[largest]:.3g} s, under {IDENTIFIABLE}× "
            f"the {t[smallest]:.3g} s of {n[smallest]:.0f} bytes; measure larger sizes"
        )
    rows = np.column_stack([np.ones_like(n), n]) / t[:, None]
    scale = rows.max(axis=0)
    (alpha, beta), *_ = np.linalg.lstsq(rows / scale, np.ones_like(t), rcond=None)
    alpha, beta = alpha / scale[0], beta / scale[1]
    if alpha < 0:
        alpha, beta = 0.0, float(np.sum(n / t) / np.sum((n / t) ** 2))  # relative least squares, β alone
    if beta <= 0:
        raise ValueError(f"the fit gives β = {beta:.3g} s/byte: the times do not grow with the size")
    return float(alpha), float(beta)
