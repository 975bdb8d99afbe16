"""Which parts of a transformer are recomputed: ``none``, ``selective``, ``full``, or full on the first K.

- ``selective`` (Korthikanti et al. 2022): the attention core — softmax(q·kᵀ)·v with mask and dropout —
  runs again in backward: it keeps the (batch, heads, seq, seq) tensors that grow with the square of the
  sequence for a small share of the layer's flops; the matmul outputs stay saved (``34·sbh`` per layer
  instead of ``sbh(34 + 5as/h)``).
- ``full``: each block keeps only its input (``2sbh``) and runs its forward again, about one more forward
  per step; ``layers=K`` recomputes only the first K blocks of each stage, the knob between the two costs.

It is applied to the blocks a rank holds once the model is cut (tensor-parallel layers, pipeline stages),
so it composes with every strategy: it changes how a block's forward runs, never its parameters or
collectives (a recomputed block runs expert parallelism's all-to-alls again, in the same order on every
rank). A block is any :class:`~meshwise.parallel.protocols.RecomputableBlock`, its attention cores the
:class:`~meshwise.parallel.protocols.SplitAttention` modules inside it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from torch import Tensor, nn

from meshwise.parallel.protocols import RecomputableBlock, split_attentions
from meshwise.parallel.recompute.region import recomputed

MODES = ("none", "selective", "full")


def check_recompute(mode: str, layers: int | None, stage_blocks: int | None = None) -> None:
    """Raise ``ValueError`` naming the fix for a policy that cannot be applied (plain arithmetic, so a CLI
    calls it before any rank starts); ``stage_blocks`` is the fewest blocks any stage holds."""
    if mode not in MODES:
        raise ValueError(f"--recompute {mode!r} is unknown; choose one of {', '.join(MODES)}")
    if layers is None:
        return
    if mode != "full":
        raise ValueError(
            f"--recompute-layers {layers} chooses blocks for full recomputation: add --recompute full"
        )
    if layers < 1:
        raise ValueError(f"--recompute-layers must be at least 1, got {layers}")
    if stage_blocks is not None and layers > stage_blocks:
        raise ValueError(
            f"--recompute-layers {layers} is larger than the {stage_blocks} blocks of a stage: choose at "
            f"most {stage_blocks} (or drop --recompute-layers to recompute every block)"
        )


def apply_recompute(blocks: Sequence[RecomputableBlock], mode: str, layers: int | None = None) -> None:
    """Set how each of ``blocks`` (one stage's, in forward order) runs; idempotent and reversible
    (``mode="none"`` restores plain forwards), parameters untouched."""
    check_recompute(mode, layers, len(blocks))
    full = len(blocks) if layers is None else layers
    for index, block in enumerate(blocks):
        block.run_body = partial(_recompute_body, block) if mode == "full" and index < full else None
        for attention in split_attentions(block):  # type: ignore[arg-type]
            attention.run_core = _recompute_core if mode == "selective" else None


def _recompute_body(block: nn.Module, body: Callable[..., Tensor], x: Tensor) -> Tensor:
    return recomputed(body, x, owners=[block])  # the block's own random states (tensor parallel) replayed


def _recompute_core(core: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return recomputed(core, q, k, v)  # runs inside any random state the attention swapped in: replayed
