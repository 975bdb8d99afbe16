"""``meshwise train gpt``'s side of the seam (:mod:`meshwise.train.step`): how the GPT is cut.

The loop (:mod:`meshwise.train.gpt.loop`) asks :func:`parallelize` for a
:class:`~meshwise.train.step.ParallelStep` and then only calls its methods; :func:`check_supported`
refuses, before any rank starts, a combination that cannot be built. The data-parallel and ZeRO steps are
model-agnostic (:class:`~meshwise.train.step.DataParallelStep`, :class:`~meshwise.train.zero_step.ZeroStep`);
what is the GPT's is supplied here: the (vocabulary-parallel) loss and a MoE's auxiliary losses
(:class:`LayerSharded`), the AdamW groups, the experts' replicas under ``--ep`` (:func:`expert_replicas`),
ZeRO's flat-group kinds (:func:`tensor_parallel_key`), ``--dtype`` and units (the blocks), and the plain GPT's
meta shape for the checkpoint layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from meshwise.comm.api import Communicator
from meshwise.comm.mesh import Mesh
from meshwise.models.gpt import GPT, language_model_loss
from meshwise.models.gpt_plan import gpt_plan
from meshwise.models.moe import moe_layers, with_auxiliary_losses
from meshwise.parallel import DataParallel
from meshwise.parallel.context_parallel import apply_context_parallel
from meshwise.parallel.expert_parallel import ExchangeTimer, ExpertReplicas, apply_expert_parallel
from meshwise.parallel.plan import ParallelPlan
from meshwise.parallel.protocols import recomputable_blocks
from meshwise.parallel.recompute import apply_recompute
from meshwise.parallel.state_dict import PlainLayout
from meshwise.parallel.tensor_parallel import shard_dim
from meshwise.train.gpt.config import GPTTrainConfig
from meshwise.train.gpt.context_parallel import check_context_parallel_config
from meshwise.train.gpt.optimizer import build_optimizer, decays
from meshwise.train.gpt.resolve import GPTRun
from meshwise.train.step import DataParallelStep, Local, ParallelStep
from meshwise.train.zero_step import ZeroStep


@dataclass(frozen=True)
class LayerSharded(Local):
    """The model after the strategies that cut layers (:func:`shard_layers`), with the loss of its
    (possibly vocabulary-sharded) output and a MoE's auxiliary losses: what the pipeline and data
    parallelism / ZeRO then cut and wrap. ``model`` is the whole GPT or its tp shard (± only its experts)."""

    plan: ParallelPlan
    tp: Communicator


def shard_layers(model: GPT, mesh: Mesh, config: GPTTrainConfig) -> LayerSharded:
    """Steps 1, 2 and 2b of :func:`parallelize`, in place on ``model`` (cp after tp: it changes only how
    the heads a rank holds attend, and wraps sequence parallelism's position lookup)."""
    plan = gpt_plan(model.config)
    loss = plain_loss
    if mesh.tp.world_size > 1:
        assert plan.tensor_parallel is not None  # check_supported refused it otherwise
        tensor_parallel = plan.tensor_parallel
        tensor_parallel.convert(model, mesh.tp, config.mesh.sp)

        def loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
            return tensor_parallel.loss(logits.float(), targets, mesh.tp, reduction)

    # 2. the attention over the cp group and the positions of this rank's chunks (the loop feeds it
    # split_sequence of each batch); a no-op for a cp group of one
    apply_context_parallel(model, mesh.cp)
    timer = None
    if mesh.ep.world_size > 1:  # 2b. experts: this rank keeps E/ep of each MoE layer's, tokens all-to-all
        apply_expert_parallel(model, mesh.ep)
        timer = ExchangeTimer() if config.profile.profiling else None
        for layer in moe_layers(model):
            layer.exchange.timer = timer  # type: ignore[attr-defined]
    return LayerSharded(model, loss, with_auxiliary_losses, timer, plan, mesh.tp)


def plain_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy over whole logits, computed in float32 (as autocast would)."""
    if reduction == "mean":
        return language_model_loss(logits.float(), targets)
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
    )


class GPTDataParallelStep(DataParallelStep):
    """:class:`~meshwise.train.step.DataParallelStep` of this rank's GPT — the whole model,
    or with ``--tp`` its tensor-parallel shard — over ``mesh.replicas``. With ``--ep`` the model holds E/ep
    experts per layer and :class:`~meshwise.parallel.DataParallel` averages dense gradients over
    ``mesh.replicas`` and expert gradients over ``mesh.expert_replicas``."""

    def __init__(self, sharded: LayerSharded, mesh: Mesh, config: GPTTrainConfig) -> None:
        def wrap(model: nn.Module) -> nn.Module:
            return DataParallel(model, mesh.replicas, experts=expert_replicas(mesh))

        optimizer = partial(build_optimizer, config=config.optimizer)
        super().__init__(sharded, mesh, optimizer, config.model.torch_dtype, wrap=wrap)

    def sampling_model(self) -> nn.Module:
        """Under ``--cp`` always gathered into a plain GPT: the rank's own attention is collective over its
        cp group, while rank 0 samples alone."""
        return ParallelStep.full_model(self) if self.mesh.cp.world_size > 1 else self.full_model()


def tensor_parallel_key(name: str, param: nn.Parameter) -> tuple[bool, bool]:
    """ZeRO's flat groups never mix kinds the step treats apart: AdamW's decayed and undecayed
    parameters, and tensor-parallel shards and parameters replicated over tp (a group's gradient shard
    then has one placement, so the global norm counts it exactly once)."""
    return decays(name, param), shard_dim(param) is not None


def expert_replicas(mesh: Mesh) -> ExpertReplicas | None:
    """Under ``--ep``: the experts, replicated over ``mesh.expert_replicas`` (dp·cp) only, their
    gradients there averaged and divided by ep (see :mod:`~meshwise.parallel.expert_parallel.placement`);
    what DataParallel, the pipeline's stage reducers and ZeRO each take as ``experts``."""
    ep = mesh.ep.world_size
    return ExpertReplicas(mesh.expert_replicas, ep) if ep > 1 else None


def check_supported(run: GPTRun) -> None:
    """A clear error, before any rank starts, for a composition that cannot be built (or is not yet)."""
    mesh = run.config.mesh
    if mesh.sp and mesh.tp < 2:
        raise ValueError("--sp splits the sequence across the tensor-parallel ranks: add --tp 2 or more")
    run.config.mesh_shape(run.world_size)  # the degree checks: sizes that divide the ranks
    check_context_parallel_config(run)
    local_seq = run.seq_len // mesh.cp  # what tensor (± sequence) parallelism sees of it
    gpt_plan(run.model_config).check_tensor_parallel(mesh.tp, mesh.sp, local_seq)


def parallelize(model: GPT, mesh: Mesh, run: GPTRun) -> ParallelStep:
    """This rank's :class:`ParallelStep` for ``model`` (built identically on every rank, converted in
    place) over ``mesh``.

    Strategies apply in one fixed order, whatever the combination:

    1. tensor parallelism (± sequence parallelism) — the model's plan converts it to this rank's shard
       over ``mesh.tp`` (:func:`shard_layers`);
    2. context parallelism over ``mesh.cp`` — attention over the cp group, positions of the rank's
       chunks (:func:`shard_layers`; the loop feeds each rank its chunks of every sequence);
    3. the pipeline — the (tensor-parallel) model cut into stages along the plan's layers, over
       ``mesh.pp`` (:class:`~meshwise.train.gpt.pipeline_step.PipelineStep`);
    4. activation recomputation of the layers this rank runs;
    5. data parallelism over ``mesh.replicas`` (dp, and cp: ranks with the same weights and other
       tokens) of what the rank holds: DataParallel's bucketed all-reduce
       (:class:`GPTDataParallelStep`), or ZeRO-1/2/3 sharding those (tensor-parallel) parameters further
       (:class:`~meshwise.train.zero_step.ZeroStep`).

    So ZeRO shards tensor-parallel shards, never the reverse (Megatron's distributed optimizer; FSDP2
    over DTensor TP).
    """
    from meshwise.train.gpt.pipeline_step import PipelineStep  # it uses LayerSharded (above)

    check_supported(run)
    config = run.config
    with torch.device("meta"):  # the plain model's names and groups, before the strategies cut it
        shape = GPT(model.config)
        plain = PlainLayout.of(shape, build_optimizer(shape, config.optimizer))
    sharded = shard_layers(model, mesh, config)
    if config.mesh.pp > 1:  # 3. (with 5. per stage)
        step: ParallelStep = PipelineStep(sharded, mesh, config)
    elif config.mesh.zero:
        step = ZeroStep(
            sharded,
            mesh,
            partial(build_optimizer, config=config.optimizer),
            config.mesh.zero,
            mixed_precision=config.model.dtype,  # fp32 | bf16 | fp16, as shard() spells them
            separate_by=tensor_parallel_key,
            units=sharded.plan.layer_modules(sharded.model) if config.mesh.zero == 3 else None,
            experts=expert_replicas(mesh),
        )
    else:
        step = GPTDataParallelStep(sharded, mesh, config)
    step.plain, step.plain_model = plain, partial(GPT, model.config)
    # 4. --recompute: on the blocks this rank runs, whatever cut them ("none" keeps plain forwards)
    apply_recompute(recomputable_blocks(step.model), config.mesh.recompute, config.mesh.recompute_layers)
    return step
