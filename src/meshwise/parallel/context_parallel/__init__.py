"""Context parallelism: each sequence split over a ``cp`` group of ranks.

``chunks`` says which tokens a rank holds (2·cp chunks, rank r gets r and 2·cp−1−r, so causal work is
balanced), ``attention`` is causal attention over the group (all-gather keys and values forward,
reduce-scatter their gradients backward), ``model`` converts a model (:func:`apply_context_parallel`)
and averages loss and gradients over the group. See docs/recompute_and_cp.md.
"""

from meshwise.parallel.context_parallel.attention import context_parallel_attention
from meshwise.parallel.context_parallel.chunks import (
    check_context_parallel,
    chunk_indices,
    local_positions,
    merge_sequence,
    split_sequence,
)
from meshwise.parallel.context_parallel.model import apply_context_parallel, average_gradients, group_mean

__all__ = [
    "apply_context_parallel",
    "average_gradients",
    "check_context_parallel",
    "chunk_indices",
    "context_parallel_attention",
    "group_mean",
    "local_positions",
    "merge_sequence",
    "split_sequence",
]
