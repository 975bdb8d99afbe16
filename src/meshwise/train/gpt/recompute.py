"""``train gpt --recompute none|selective|full [--recompute-layers K]``: checked before launch (then
:func:`~meshwise.parallel.recompute.apply_recompute` sets it on the blocks each rank runs, once
:func:`~meshwise.train.gpt.parallelize.parallelize` has cut the model).
"""

from __future__ import annotations

import torch

from meshwise.models.gpt import GPT
from meshwise.models.gpt_plan import gpt_plan
from meshwise.parallel.pipeline_parallel.partition import balanced_split, block_weights
from meshwise.parallel.recompute import check_recompute
from meshwise.train.gpt.resolve import GPTRun


def check_recompute_config(run: GPTRun) -> None:
    """One clear ``ValueError`` for --recompute flags that cannot be applied; --recompute-layers must fit
    the fewest blocks any pipeline rank runs, as the pipeline will cut them."""
    mesh, model = run.config.mesh, run.model_config
    stage = model.layers
    if mesh.recompute_layers is not None and mesh.pp > 1:
        with torch.device("meta"):
            blocks, embed, head = block_weights(GPT(model), gpt_plan(model))
        sizes = balanced_split(blocks, mesh.pp * mesh.virtual_stages, first_extra=embed, last_extra=head)
        stage = min(sum(sizes[rank :: mesh.pp]) for rank in range(mesh.pp))
    check_recompute(mesh.recompute, mesh.recompute_layers, stage)
