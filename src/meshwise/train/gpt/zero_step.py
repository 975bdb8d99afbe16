"""``meshwise train gpt --zero 1|2|3``: the model-agnostic :class:`~meshwise.train.zero_step.ZeroStep`
given what is the GPT's: AdamW's decay groups and tensor-parallel shards kept apart in the flat groups
(:func:`tensor_parallel_key`: each master shard then belongs to one optimizer group and has one
placement, so the update and the norm are the plain model's, element for element), ``--dtype`` as the
compute copies' precision, the GPT blocks as stage 3's units, and under ``--ep`` the experts sharded
over their own replicas (:func:`expert_replicas`). Under ``--pp`` each stage's ZeRO uses the same
options (:func:`~meshwise.train.gpt.pipeline_step.stage_zero`).
"""

from __future__ import annotations

from functools import partial

from torch import nn

from meshwise.comm.mesh import Mesh
from meshwise.parallel.expert_parallel import is_expert_parameter
from meshwise.parallel.tensor_parallel import shard_dim
from meshwise.parallel.zero.replicas import ReplicaGroup
from meshwise.train.gpt.config import GPTTrainConfig
from meshwise.train.gpt.optimizer import decays, sharded_adamw
from meshwise.train.gpt.parallelize import LayerSharded
from meshwise.train.zero_step import ZeroStep


def tensor_parallel_key(name: str, param: nn.Parameter) -> tuple[bool, bool]:
    """ZeRO's flat groups never mix kinds the step treats apart: AdamW's decayed and undecayed
    parameters, and tensor-parallel shards and parameters replicated over tp (a group's gradient shard
    then has one placement, so the global norm counts it exactly once)."""
    return decays(name, param), shard_dim(param) is not None


class GPTZeroStep(ZeroStep):
    """:class:`~meshwise.train.zero_step.ZeroStep` of this rank's GPT (or its tp shard) over
    ``mesh.replicas``, with the options the module docstring lists."""

    def __init__(self, sharded: LayerSharded, mesh: Mesh, config: GPTTrainConfig) -> None:
        super().__init__(
            sharded,
            mesh,
            partial(sharded_adamw, config=config.optimizer),
            config.mesh.zero,
            mixed_precision=config.model.dtype,  # fp32 | bf16 | fp16, as shard() spells them
            separate_by=tensor_parallel_key,
            units=sharded.plan.layer_modules(sharded.model) if config.mesh.zero == 3 else None,
            replica_groups=expert_replicas(mesh),
        )


def expert_replicas(mesh: Mesh) -> tuple[ReplicaGroup, ...]:
    """Under ``--ep``: the experts, replicated over ``mesh.expert_replicas`` (dp·cp) only, their
    gradients there averaged and divided by ep (the combine's backward all-to-all already summed the ep
    ranks' tokens into each expert: see :mod:`~meshwise.parallel.expert_parallel.placement`)."""
    ep = mesh.ep.world_size
    if ep == 1:
        return ()
    owns = lambda name, _param: is_expert_parameter(name)  # noqa: E731
    return (ReplicaGroup("experts", mesh.expert_replicas, owns, grad_scale=1 / ep),)
