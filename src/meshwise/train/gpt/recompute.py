"""``train gpt --recompute none|selective|full [--recompute-layers K]``: checked before launch, applied
(:func:`recompute_step`) to the blocks each rank runs once its strategy has cut the model.
"""

from __future__ import annotations

import torch

from meshwise.models.gpt import GPT
from meshwise.models.gpt_plan import gpt_plan
from meshwise.parallel.pipeline_parallel.partition import balanced_split, block_weights
from meshwise.parallel.protocols import recomputable_blocks
from meshwise.parallel.recompute import apply_recompute, check_recompute
from meshwise.train.gpt.resolve import GPTRun
from meshwise.train.gpt.sections import GPTMeshSection


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


def recompute_step(model: torch.nn.Module, mesh: GPTMeshSection) -> None:
    """Apply the mesh section's recomputation to the blocks of ``model`` (a rank's model, wrapped or not)."""
    if mesh.recompute != "none":
        apply_recompute(recomputable_blocks(model), mesh.recompute, mesh.recompute_layers)
