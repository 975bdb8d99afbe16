"""``meshwise plan``: predict per-rank memory and step time of every layout, rank them, explain.

Pure arithmetic over published formulas and this repository's own cost model and pipeline schedules;
nothing here starts a process (``--validate`` runs candidates through :mod:`meshwise.train.trial`).
"""

from meshwise.plan.hardware import NAMES as GPU_NAMES
from meshwise.plan.hardware import Hardware, hardware, with_overrides
from meshwise.plan.layout import Layout, check
from meshwise.plan.memory import MemoryEstimate, Precision, estimate_memory, model_states
from meshwise.plan.model import ModelSpec
from meshwise.plan.search import Candidate, Plan, Problem, advise
from meshwise.plan.step_time import TimeEstimate, estimate_time

__all__ = [
    "GPU_NAMES",
    "Candidate",
    "Hardware",
    "Layout",
    "MemoryEstimate",
    "ModelSpec",
    "Plan",
    "Precision",
    "Problem",
    "TimeEstimate",
    "advise",
    "check",
    "estimate_memory",
    "estimate_time",
    "hardware",
    "model_states",
    "with_overrides",
]
