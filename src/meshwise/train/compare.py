"""Loss parity of training layouts against one process: the analysis behind ``meshwise compare``.

A layout is written the way people say it: ``dp2``, ``tp2``, ``pp2,m=4``, ``zero3``, ``dp2,tp2,sp``,
``pp2,m=4,schedule=interleaved,v=2``; parts are separated by ``,``, ``·`` or ``+``. Every layout trains
the same model from the same seed (so the same initial weights and token order) as the one-process
reference; :func:`compare_runs` finds, for each, the largest |Δloss| at every step, the first step whose
difference exceeds the tolerance, and — from the weights each run exported after its last step — the
first parameter (in the model's order) that differs by more than the tolerance.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from meshwise.train.trial import TrialResult

#: short names → train gpt flag dests (a TrialSpec layout)
_KEYS = {"m": "micro_batches", "mb": "micro_batch", "schedule": "schedule", "v": "virtual_stages"}
_SIZED = re.compile(r"^(dp|tp|pp|zero)(\d+)$")

#: fp32 runs of one model that sum in another order differ by ~1e-7 relative per operation; over a few
#: AdamW steps (whose update m/√v magnifies tiny gradients' rounding) measured gaps on gpt-tiny stay below
#: 1e-5 in the loss and the weights (tp2, pp2, dp2 after 5 steps), so 1e-4 separates rounding from a bug.
DEFAULT_TOLERANCE = 1e-4


def parse_layout(text: str, default_ranks: int) -> tuple[int, dict[str, int | str | bool]]:
    """(ranks, train gpt layout settings) of ``text``; dp fills the ranks tp·pp leave (else ValueError)."""
    settings: dict[str, int | str | bool] = {}
    for part in filter(None, re.split(r"[,·+\s]+", text.strip())):
        sized = _SIZED.match(part)
        if sized:
            settings[sized.group(1)] = int(sized.group(2))
        elif part == "sp":
            settings["sp"] = True
        elif "=" in part and part.split("=", 1)[0] in _KEYS:
            key, value = part.split("=", 1)
            if key != "schedule" and (not value.isdigit() or int(value) < 1):
                raise ValueError(f"layout {text!r}: {value!r} must be a positive integer")
            settings[_KEYS[key]] = value if key == "schedule" else int(value)
        else:
            raise ValueError(
                f"layout {text!r}: cannot read {part!r}; write e.g. dp2, tp2, pp2,m=4, zero3, "
                "dp2,tp2,sp or pp2,m=4,schedule=interleaved,v=2"
            )
    model = int(settings.get("tp", 1)) * int(settings.get("pp", 1))
    if "dp" not in settings:
        if default_ranks % model:
            raise ValueError(f"layout {text!r}: tp·pp = {model} does not divide --np {default_ranks}")
        settings["dp"] = default_ranks // model
    ranks = int(settings["dp"]) * model
    return ranks, settings


@dataclass(frozen=True)
class Parity:
    """One layout against the reference."""

    layout: str
    ranks: int
    ok: bool  # the run finished
    error: str
    max_delta: tuple[float, ...]  # |Δloss| per step
    first_step: int | None  # 1-based step whose |Δloss| exceeds the tolerance
    first_tensor: str | None  # first parameter (model order) beyond the tolerance after the last step
    tensor_delta: float | None  # its max |Δ|, or the largest over all tensors when none diverges
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.ok and self.first_step is None and self.first_tensor is None

    def to_json(self) -> dict:
        return asdict(self) | {"passed": self.passed}


def _natural(name: str) -> list:
    """``h.10`` after ``h.9``: the model's order, not the file's alphabetical one."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def weight_divergence(reference: str, other: str, tolerance: float) -> tuple[str | None, float]:
    """(first tensor beyond ``tolerance`` or None, its max |Δ| or the largest of all) of two exports."""
    from safetensors.torch import load_file

    ref, got = load_file(reference), load_file(other)
    if ref.keys() != got.keys():
        missing = sorted(set(ref) ^ set(got))[0]
        return missing, float("inf")
    largest = 0.0
    for name in sorted(ref, key=_natural):
        delta = (ref[name].double() - got[name].double()).abs().max().item()
        if delta > tolerance:
            return name, delta
        largest = max(largest, delta)
    return None, largest


def compare_runs(name: str, reference: TrialResult, run: TrialResult, tolerance: float) -> Parity:
    if not run.ok:
        return Parity(name, run.spec.ranks, False, run.error, (), None, None, None, tolerance)
    deltas = tuple(abs(a - b) for a, b in zip(reference.losses, run.losses, strict=True))
    first = next((i + 1 for i, d in enumerate(deltas) if d > tolerance), None)
    tensor, delta = None, None
    if reference.weights and run.weights:
        tensor, delta = weight_divergence(reference.weights, run.weights, tolerance)
    return Parity(name, run.spec.ranks, True, "", deltas, first, tensor, delta, tolerance)


def table(parities: list[Parity]) -> str:
    """Per step the |Δloss| of every layout, then one verdict line per layout."""
    steps = max((len(p.max_delta) for p in parities), default=0)
    head = f"{'step':>5}  " + "  ".join(f"{p.layout:>14}" for p in parities)
    lines = ["max |Δloss| against one process", head]
    for i in range(steps):
        cells = [f"{p.max_delta[i]:>14.3e}" if i < len(p.max_delta) else f"{'-':>14}" for p in parities]
        lines.append(f"{i + 1:>5}  " + "  ".join(cells))
    lines.append("")
    for p in parities:
        if not p.ok:
            lines.append(f"{p.layout:<16} FAIL  did not run: {p.error}")
        elif p.passed:
            lines.append(
                f"{p.layout:<16} pass  every step and every tensor within {p.tolerance:g} "
                f"(largest weight |Δ| {p.tensor_delta or 0:.2e})"
            )
        else:
            where = f"first at step {p.first_step}" if p.first_step else "loss within tolerance"
            tensor = f"; first tensor {p.first_tensor} (|Δ| {p.tensor_delta:.2e})" if p.first_tensor else ""
            lines.append(f"{p.layout:<16} FAIL  {where}{tensor}, tolerance {p.tolerance:g}")
    return "\n".join(lines)
