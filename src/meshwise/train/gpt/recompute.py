"""``train gpt --recompute none|selective|full [--recompute-layers K]``: checked before launch, applied to
the blocks each rank runs once its strategy has cut the model (so it works under dp, ZeRO, tp and pp).

:func:`recompute_step` is the one entry point the strategy seam calls after building a step.
"""

from __future__ import annotations

import torch

from meshwise.models.gpt import GPT
from meshwise.models.gpt_plan import gpt_plan
from meshwise.parallel.pipeline_parallel.partition import balanced_split, block_weights
from meshwise.parallel.recompute import apply_recompute, check_recompute, stage_blocks
from meshwise.train.gpt.config import GPTTrainConfig


def fewest_stage_blocks(config: GPTTrainConfig) -> int:
    """The fewest blocks any pipeline rank runs (all of them without --pp), as the pipeline will cut them."""
    if config.pp == 1:
        return config.model_config.layers
    with torch.device("meta"):
        blocks, embed, head = block_weights(GPT(config.model_config), gpt_plan(config.model_config))
    sizes = balanced_split(blocks, config.pp * config.virtual_stages, first_extra=embed, last_extra=head)
    return min(sum(sizes[rank :: config.pp]) for rank in range(config.pp))


def check_recompute_config(config: GPTTrainConfig) -> None:
    """One clear ``ValueError`` for --recompute flags that cannot be applied."""
    stage = fewest_stage_blocks(config) if config.recompute_layers is not None else None
    check_recompute(config.recompute, config.recompute_layers, stage)


def recompute_step(model: torch.nn.Module, config: GPTTrainConfig) -> None:
    """Apply the config's recomputation to the blocks of ``model`` (a rank's model, wrapped or not)."""
    if config.recompute != "none":
        apply_recompute(stage_blocks(model), config.recompute, config.recompute_layers)
