"""``meshwise train gpt --zero 1|2|3``: the model-agnostic :class:`~meshwise.train.zero_step.ZeroStep`
given what is the GPT's.

- AdamW with the data-parallel path's parameter groups: ``shard(separate_by=...)`` never puts decayed
  and undecayed parameters in one flat group, so each master shard belongs to exactly one optimizer group
  and the update is the plain model's, element for element — no per-element mask needed;
- ``--dtype bf16|fp16`` computes with bf16/fp16 copies of float32 master shards (fp16 with a loss scaler);
- stage 3's units are the GPT blocks (the plan's layers);
- with ``--tp`` the model arrives as this rank's tensor-parallel shard (Megatron's distributed optimizer
  layout; FSDP2 over DTensor TP with the flat range in place of its dim-0 chunk), and flat groups keep tp
  shards and tp-replicated parameters apart (:func:`tensor_parallel_key`), so each gradient shard has one
  placement;
- with ``--ep`` the dense weights are replicated over ``mesh.replicas`` (dp·ep·cp) but a rank's experts
  only over ``mesh.expert_replicas`` (dp·cp): ZeRO shards each kind over its own ranks
  (:func:`expert_replicas`), so the checkpoint holds each expert under its plain name and resumes as plain
  ``--ep``, another stage, or one process. Under ``--pp`` each stage's ZeRO does the same
  (:func:`~meshwise.train.gpt.pipeline_step.stage_zero`).
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
    ranks' tokens into each expert: see :mod:`~meshwise.parallel.expert_parallel.data_parallel`)."""
    ep = mesh.ep.world_size
    if ep == 1:
        return ()
    owns = lambda name, _param: is_expert_parameter(name)  # noqa: E731
    return (ReplicaGroup("experts", mesh.expert_replicas, owns, grad_scale=1 / ep),)
