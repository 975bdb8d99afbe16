"""Tensor and sequence parallelism (Megatron-LM style) over any Communicator.

``regions`` holds the autograd communication ops, ``layers`` the column/row-parallel linears, ``vocab``
the vocabulary-parallel embedding and cross-entropy, ``shards`` reassembles full tensors; which layers
become which is the model's own plan (:mod:`meshwise.models.gpt_plan`). See docs/tensor_parallel.md.
"""

from meshwise.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, shard_dim
from meshwise.parallel.tensor_parallel.regions import (
    copy_to_region,
    gather_from_sequence,
    gather_last,
    reduce_from_region,
    scatter_to_sequence,
    split_last,
)
from meshwise.parallel.tensor_parallel.shards import full_tensors
from meshwise.parallel.tensor_parallel.vocab import padded_vocab, vocab_parallel_cross_entropy

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "copy_to_region",
    "full_tensors",
    "gather_from_sequence",
    "gather_last",
    "padded_vocab",
    "reduce_from_region",
    "scatter_to_sequence",
    "shard_dim",
    "split_last",
    "vocab_parallel_cross_entropy",
]
