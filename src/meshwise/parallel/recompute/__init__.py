"""Activation recomputation: trade a second forward for the memory of saved activations.

``region`` is the mechanism (run a function, keep its inputs, recompute the rest in backward with the same
random numbers), ``policy`` decides which parts of a transformer use it (``--recompute``), ``saved``
measures what autograd keeps per layer, ``formulas`` says what it should keep. See docs/recompute_and_cp.md.
"""

from meshwise.lazy import lazy_names

# lazily: the planner reads the formulas (torch-free) without the mechanism
__getattr__, __dir__ = lazy_names(
    __name__,
    {
        "meshwise.parallel.recompute.policy": ("MODES", "apply_recompute", "check_recompute"),
        "meshwise.parallel.recompute.region": ("recomputed",),
        "meshwise.parallel.recompute.saved": ("SavedBytes", "saved_bytes"),
    },
)

__all__ = [
    "MODES",
    "SavedBytes",
    "apply_recompute",
    "check_recompute",
    "recomputed",
    "saved_bytes",
]
