"""The collective calls a layout's tensor-parallel group makes per micro-batch, counted from the code.

Priced one by one (α + β·bytes each, :func:`meshwise.plan.step_time.call_seconds`): on a host where a
call's latency is a millisecond, a hundred small calls cost more than their bytes, so one aggregate of
"b·s·h four times per layer" mis-ranks layouts. Counts per transformer layer and micro-batch, training
(forward + backward), as :mod:`meshwise.parallel.tensor_parallel` and :mod:`meshwise.models.gpt_plan`
issue them (``tests/test_plan_calls.py`` counts them with a counting communicator):

- **tp**: attention and MLP each enter the region with ``copy_to_region`` (identity forward, all-reduce
  backward) and leave it with ``reduce_from_region`` (all-reduce forward): 2 + 2 all-reduces of b·s·h.
- **tp + sp**: each entry is ``gathered_linears`` (all-gather forward; all-gather again and reduce-scatter
  backward) and each exit ``scatter_to_sequence`` (reduce-scatter forward, all-gather backward): forward
  2 all-gathers + 2 reduce-scatters, backward 4 all-gathers + 2 reduce-scatters, all of b·s·h; and every
  replicated parameter sums its gradient over the sequence shards (``sum_gradient_over``): two
  LayerNorms' weight and bias and the two row-parallel biases, 6 all-reduces of h values per layer.
- **full recomputation** runs each layer's forward again in backward: its forward calls once more.
- **ends**: the vocabulary-parallel embedding all-reduces (sp: reduce-scatters) b·s·h forward, and under
  sp all-gathers its gradient back; the head is one more entry (tp: one all-reduce backward; sp: as
  ``gathered_linears``); the loss all-reduces the per-token maximum and sums (2 × b·s fp32 values); under
  sp the position table (seq·h) and the final LayerNorm (2 × h) sum their gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshwise.plan.layout import Layout
from meshwise.plan.memory import Precision
from meshwise.plan.model import ModelSpec

FP32 = 4


@dataclass(frozen=True)
class Calls:
    """``count`` calls of ``collective`` moving ``nbytes`` each (counted as the cost formulas count)."""

    collective: str
    nbytes: float
    count: int


def tensor_parallel_calls(model: ModelSpec, layout: Layout, precision: Precision) -> tuple[Calls, ...]:
    """The tp group's calls of one micro-batch on the busiest pipeline stage (its layers, and the
    embedding and head ends, which a pipeline's first and last stages hold — both priced on one stage)."""
    if layout.tp == 1:
        return ()
    c = model.config
    layers = -(-c.layers // layout.pp)
    activation = layout.micro_batch * c.seq_len * c.hidden * precision.value
    tokens = layout.micro_batch * c.seq_len * FP32
    forwards = 2 if layout.recompute == "full" else 1
    loss = Calls("all_reduce", tokens, 2)
    if not layout.sp:
        return (Calls("all_reduce", activation, layers * (2 * forwards + 2) + 2), loss)
    replicated = FP32 * c.hidden  # gradients are kept in fp32 (the master copy's dtype)
    return (
        Calls("all_gather", activation, layers * (2 * forwards + 4) + 3),
        Calls("reduce_scatter", activation, layers * (2 * forwards + 2) + 2),
        Calls("all_reduce", replicated, 6 * layers + 2),
        Calls("all_reduce", FP32 * c.seq_len * c.hidden, 1),
        loss,
    )
