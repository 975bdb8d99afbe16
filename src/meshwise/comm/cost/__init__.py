"""The α-β-γ cost model of collectives, in three parts.

- :mod:`~meshwise.comm.cost.formulas`: :class:`LinkParams` and the per-algorithm coefficient formulas
  (Thakur, Rabenseifner & Gropp 2005, plus the σ/δ terms of ranks sharing cores);
- :mod:`~meshwise.comm.cost.calibration`: a machine's links, the built-in defaults and the file format;
  :mod:`~meshwise.comm.cost.fit` fits them to measurements;
- which algorithm implements what and costs which formula is the registry
  (:mod:`meshwise.comm.algorithms.registry`, with ``predict_seconds``), and the ``auto`` choice sits next
  to it (:mod:`meshwise.comm.algorithms.choice`).

Only the first two are imported here: they depend on nothing else of meshwise, so the registry can use
them without a cycle.
"""

from meshwise.comm.cost.calibration import BUILTIN, DEFAULT_FILE, Calibration, CostSample, Levels, WorldLinks
from meshwise.comm.cost.formulas import PARAMETERS, Coefficients, LinkParams

__all__ = [
    "BUILTIN",
    "DEFAULT_FILE",
    "PARAMETERS",
    "Calibration",
    "Coefficients",
    "CostSample",
    "Levels",
    "LinkParams",
    "WorldLinks",
]
