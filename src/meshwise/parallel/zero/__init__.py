"""Sharded data parallelism (ZeRO stages 1–3, FSDP-style): see docs/zero.md."""

from meshwise.parallel.zero.memory import MemoryReport, zero_formula
from meshwise.parallel.zero.precision import LossScaler, MixedPrecision
from meshwise.parallel.zero.sharded import ShardedModel, shard

__all__ = ["LossScaler", "MemoryReport", "MixedPrecision", "ShardedModel", "shard", "zero_formula"]
