"""How good a plan was: predicted against measured, over the candidates that were run.

- mean absolute percentage error, |predicted − measured| / measured averaged over candidates;
- Spearman's rank correlation of predicted and measured step times (does the plan order layouts right?);
- regret: the measured time of the layout the plan ranked first over the best measured time (1.0 = the
  plan's pick was the fastest of those run).
"""

from __future__ import annotations

from collections.abc import Sequence


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    pairs = list(zip(predicted, measured, strict=True))
    return sum(abs(p - m) / m for p, m in pairs) / len(pairs)


def _ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Pearson correlation of the ranks (NaN with fewer than two values or a constant side)."""
    if len(a) < 2:
        return float("nan")
    ra, rb = _ranks(a), _ranks(b)
    mean = (len(a) + 1) / 2
    cov = sum((x - mean) * (y - mean) for x, y in zip(ra, rb, strict=True))
    var = (sum((x - mean) ** 2 for x in ra) * sum((y - mean) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def regret(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Measured time of the predicted-fastest candidate over the fastest measured time."""
    pick = min(range(len(predicted)), key=predicted.__getitem__)
    return measured[pick] / min(measured)
