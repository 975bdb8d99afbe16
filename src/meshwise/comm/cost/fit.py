"""Fitting a link's parameters to measured times (what ``meshwise bench --calibrate`` does with them)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from meshwise.comm.algorithms.registry import coefficients
from meshwise.comm.cost.calibration import CostSample
from meshwise.comm.cost.formulas import PARAMETERS, LinkParams

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
