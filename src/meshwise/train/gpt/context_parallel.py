"""``train gpt --cp N``: context parallelism's checks before launch (the model side is
:func:`~meshwise.parallel.context_parallel.apply_context_parallel`; the loop cuts each batch into this
rank's tokens with :func:`~meshwise.parallel.context_parallel.split_sequence`).

Every cp rank reads the same sequences as the rest of its group (``mesh.batch`` leaves ``cp`` out) and
keeps chunks ``r`` and ``2·cp−1−r`` of each, inputs and targets alike: as many tokens on every cp rank, so
averaging losses and gradients over ``mesh.replicas`` (dp·ep·cp) gives the global batch's token mean.
"""

from __future__ import annotations

from meshwise.parallel.context_parallel import check_context_parallel
from meshwise.train.gpt.resolve import GPTRun


def check_context_parallel_config(run: GPTRun) -> None:
    """One clear ``ValueError`` for a --cp this run cannot use: a sequence that does not cut into 2·cp
    equal chunks, one longer than the position table, or a mixture of experts (not composed with cp yet).
    Everything else composes: dp, ZeRO 1–3, tp ± sp, pp, recomputation, bf16/fp16, dropout, --compile."""
    cp = run.config.mesh.cp
    if cp == 1:
        return
    check_context_parallel(run.seq_len, cp, run.model_config.seq_len)
    if run.model_config.experts:
        # the load-balancing loss of a rank's tokens is not the sequence's: the router's statistics would
        # have to be summed over the cp group first (Megatron sums them over tp·cp)
        raise ValueError("--experts with --cp is not built yet: drop --cp or --experts")
