"""Activation recomputation: trade a second forward for the memory of saved activations.

``region`` is the mechanism (run a function, keep its inputs, recompute the rest in backward with the same
random numbers), ``policy`` decides which parts of a transformer use it (``--recompute``), ``saved``
measures what autograd keeps per layer, ``formulas`` says what it should keep. See docs/recompute_and_cp.md.
"""

from meshwise.parallel.recompute.policy import MODES, apply_recompute, check_recompute, stage_blocks
from meshwise.parallel.recompute.region import recomputed
from meshwise.parallel.recompute.saved import SavedBytes, note_kept, saved_bytes

__all__ = [
    "MODES",
    "SavedBytes",
    "apply_recompute",
    "check_recompute",
    "note_kept",
    "recomputed",
    "saved_bytes",
    "stage_blocks",
]
