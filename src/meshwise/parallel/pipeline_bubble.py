"""The pipeline bubble by formula, outside ``pipeline_parallel/`` so that the planner, which prices
schedules by it, does not import that package (its executor and partition need torch).

:mod:`meshwise.parallel.pipeline_parallel.simulator` measures the same fraction on a schedule; the tests hold
the two equal.
"""

from __future__ import annotations


def theoretical_bubble(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """(p−1)/(v·m+p−1): the idle fraction of GPipe and 1F1B (v = 1) and of interleaved 1F1B."""
    return (stages - 1) / (virtual_stages * micro_batches + stages - 1)
