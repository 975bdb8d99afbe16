"""``meshwise train gpt --zero 1|2|3``: ZeRO sharded data parallelism over ``mesh.dp``.

The model is wrapped by :func:`~meshwise.parallel.zero.shard` (stage 3's units: the GPT blocks). What the
seam's contract asks of a sharded strategy, and how it is met here:

- AdamW with the data-parallel path's parameter groups (decay on matrices and embeddings, none on biases
  and LayerNorm gains): ``shard(separate_by=...)`` never puts the two kinds in one flat group, so each
  master shard belongs to exactly one optimizer group and the update is the plain model's, element for
  element — no per-element mask needed;
- the gradient norm for clipping is the whole model's (squares of every rank's shard, all-reduced);
- ``--dtype bf16`` computes with bf16 copies of float32 master shards (gathers and gradients in bf16);
  ``--dtype fp16`` does the same in float16 with a :class:`~meshwise.parallel.zero.LossScaler`: the loss
  is scaled before backward, the shards unscaled in float32 before clipping, and a step whose gradient
  overflowed on any rank is skipped on every rank (the loop's ``optimizer.step()`` then finds no gradient);
- checkpoints use the plain model's names and shapes, model and AdamW state alike — the layout of a
  data-parallel checkpoint — so a run resumes under any stage, as plain data parallelism, or on another
  number of ranks; but each tensor is a ``ShardedTensor`` of the rectangles of this rank's flat range,
  so every rank writes and reads only its own elements (never a whole tensor, never padding);
- ``full_model()`` gathers a plain GPT (collective: every rank calls it; ``--sample`` uses rank 0's).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from meshwise.comm.mesh import Mesh
from meshwise.models.gpt import GPT
from meshwise.parallel.placement import Placement, clip_gradients_
from meshwise.parallel.tensor_parallel import shard_dim
from meshwise.parallel.tensor_parallel.shards import gather_full
from meshwise.parallel.zero import LossScaler, shard
from meshwise.parallel.zero.checkpoint import Slices, sharded_tensor
from meshwise.parallel.zero.memory import rank_lines
from meshwise.parallel.zero.sharded import ShardedModel
from meshwise.train.gpt.config import GPTTrainConfig
from meshwise.train.gpt.optimizer import adamw, decays, init_optimizer_state
from meshwise.train.gpt.parallelize import Batch, LayerSharded, ParallelStep

#: --dtype → shard()'s mixed precision (float32 master shards in every case).
PRECISION = {"fp32": None, "bf16": "bf16", "fp16": "fp16"}


def check_zero(config: GPTTrainConfig) -> None:
    """--zero's own limits, before any rank starts."""
    if config.zero and config.pp > 1 and config.dtype == "fp16":
        raise ValueError(
            f"--zero {config.zero} with --pp: fp16 needs a loss scaler around the pipeline's backward, "
            "which is not built yet; use --dtype bf16 (or fp32), or drop --pp"
        )


def tensor_parallel_key(name: str, param: nn.Parameter) -> tuple[bool, bool]:
    """ZeRO's flat groups never mix kinds the step treats apart: AdamW's decayed and undecayed
    parameters, and tensor-parallel shards and parameters replicated over tp (a group's gradient shard
    then has one placement, so the global norm counts it exactly once)."""
    return decays(name, param), shard_dim(param) is not None


class ZeroStep(ParallelStep):
    """This rank's master shards, AdamW over them, and (fp16) a loss scaler.

    With ``--tp`` the model is first cut into this rank's tensor-parallel shard (the order
    :func:`~meshwise.train.gpt.parallelize.parallelize` documents: TP, then data parallelism over dp), and
    ZeRO shards those shards over ``mesh.dp``: each (dp, tp) rank holds 1/(dp·tp) of every tp-sharded
    weight and 1/dp of the replicated ones — the layout of Megatron's distributed optimizer, or FSDP2
    over DTensor TP with the flat range in place of FSDP2's dim-0 chunk. Flat groups keep tp shards and
    tp-replicated parameters apart (:func:`tensor_parallel_key`), so each gradient shard has one
    :class:`~meshwise.parallel.placement.Placement` and the global norm is the generic one.
    """

    def __init__(self, sharded: LayerSharded, mesh: Mesh, config: GPTTrainConfig) -> None:
        model = sharded.model
        super().__init__(config, mesh, next(model.parameters()).device)
        self.config, self.plan, self.tp = model.config, sharded.plan, sharded.tp
        self.sharded_loss = sharded.loss
        self.model = shard(
            model,
            mesh.dp,
            stage=config.zero,
            mixed_precision=PRECISION[config.dtype],
            separate_by=tensor_parallel_key,
            units=self.plan.layer_modules(model) if config.zero == 3 else None,
        )
        with torch.device("meta"):  # the plain model's shapes, for tensor-parallel checkpoints
            self._plain_shapes = {n: t.shape for n, t in GPT(self.config).state_dict().items()}
        self._shard_placements = [
            Placement(group.name, divided=frozenset({"dp", "tp"} if tp_sharded else {"dp"}))
            for group in self.model.groups
            for tp_sharded in [shard_dim(group.params[0]) is not None]
        ]
        decayed = self.model.parameters_where(decays)
        self.optimizer = adamw(decayed, self.model.parameters_where(lambda n, p: not decays(n, p)), config)
        self.scaler = LossScaler(mesh.job) if config.dtype == "fp16" else None  # every rank skips together

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return self.sharded_loss(self.model(inputs), targets, reduction)

    def forward_backward(self, micro_batches: Sequence[Batch]) -> float:
        return self.accumulate_gradients(
            micro_batches, self._loss, self.scaler.scale_loss if self.scaler else None
        )

    def clip_grad_norm(self, max_norm: float) -> float:
        if self.scaler is not None:
            found_inf = self.scaler.unscale_(self.model)
            self.scaler.update(found_inf)
            if found_inf:
                return math.inf  # skipped: the optimizer finds no gradient
        shards = list(zip(self.model.gradient_shards(), self._shard_placements, strict=True))
        return clip_gradients_(shards, max_norm, self.mesh.coordinates, self.mesh.job)

    @torch.no_grad()
    def eval_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._loss(inputs, targets, reduction="sum")

    def full_model(self) -> GPT:
        """The plain GPT (collective: gathered over dp by ZeRO, then over tp)."""
        full = GPT(self.config).to(self.device)
        state = self.model.state_dict()
        if self.tp.world_size > 1:
            params = self.model.module.state_dict(keep_vars=True)
            shapes = full.state_dict()
            state = {key: gather_full(state[key], params[key], self.tp, shapes[key].shape) for key in state}
        full.load_state_dict(state)
        return full

    def summary_lines(self) -> list[str]:
        """The per-rank memory report beside the ZeRO formula, and (fp16) the loss scale."""
        mixed = self.model.precision is not None
        lines = [f"Memory (ZeRO-{self.model.stage}, per rank, accounted vs formula)"]
        lines += [f"  {line}" for line in rank_lines(self.model, self.optimizer, k=8 + 4 * mixed)]
        if self.scaler is not None:
            lines.append(
                f"Loss scale          = {self.scaler.scale:g} (fp16; {self.scaler.skipped} step"
                f"{'s' if self.scaler.skipped != 1 else ''} skipped for inf/nan gradients)"
            )
        return lines

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        names = {id(g.master): n for g, n in zip(self.model.groups, self.model.param_names, strict=True)}
        groups = [[n for m in group["params"] for n in names[id(m)]] for group in self.optimizer.param_groups]
        slices = zero_slices(self.mesh, self._plain_shapes)
        result = zero_state_dict(self.model, self.optimizer, slices, groups)
        if self.scaler is not None:
            result["scaler"] = self.scaler.state_dict()
        return result

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_zero_state_dict(self.model, self.optimizer, state)
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])


def zero_state_dict(
    zero: ShardedModel,
    optimizer: torch.optim.Optimizer,
    slices_of: Callable[[str, torch.Tensor], Slices],
    group_names: list[list[str]],
    optimizer_key: Callable[[str], str] = lambda name: name,
) -> dict[str, Any]:
    """The data-parallel checkpoint layout — ``model[name]`` and ``optim.state[name][key]`` shaped like
    the plain parameter — where each tensor is a ``ShardedTensor`` whose local shards are views of this
    rank's master shard (or AdamW moment), placed on the job by ``slices_of`` (:func:`zero_slices`): DCP
    writes only this rank's elements, and loading into this dict reads only the ranges this rank's layout
    needs, in place. No rank ever holds a whole tensor, which is the point of ZeRO when a model does not
    fit. The scalar ``step`` is replicated. ``group_names``: the plain model's names of each optimizer
    group (as a data-parallel run records them); ``optimizer_key``: a parameter's key in the optimizer
    state (a pipeline's head copy keeps AdamW's state under the tied embedding's name).
    :func:`load_zero_state_dict` expects this dict back, filled by ``dcp.load``."""
    init_optimizer_state(optimizer)
    state: dict[str, dict[str, Any]] = {}
    params: dict[int, Any] = {}
    for group, names in zip(zero.groups, zero.param_names, strict=True):
        for index, (name, param) in enumerate(zip(names, group.params, strict=True)):
            slices = slices_of(name, param)
            shape = tuple(param.shape)
            params[id(param)] = sharded_tensor(group, index, group.master.detach(), shape, slices=slices)
            for key, value in optimizer.state[group.master].items():
                if _per_element(value, group.master):
                    piece = sharded_tensor(group, index, value.detach(), shape, slices=slices)
                else:  # scalar state shared by the whole shard (AdamW's step)
                    piece = value.clone() if isinstance(value, torch.Tensor) else value
                state.setdefault(optimizer_key(name), {})[key] = piece
    model = {
        key: params[id(value)] if id(value) in params else value.detach().clone()
        for key, value in zero.module.state_dict(keep_vars=True).items()
    }
    param_groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": names}
        for group, names in zip(optimizer.param_groups, group_names, strict=True)
    ]
    return {"model": model, "optim": {"state": state, "param_groups": param_groups}}


@torch.no_grad()
def load_zero_state_dict(
    zero: ShardedModel,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    optimizer_key: Callable[[str], str] = lambda name: name,
) -> None:
    """Finish a load into :func:`zero_state_dict`'s dict: DCP already wrote this rank's ranges (of a
    checkpoint from any layout: dp, tp, pp, any stage or N) into the master shards and moments through the
    local shards' views; what is left is pushing masters to the compute copies, the replicated scalars and
    buffers (the hyper-parameters stay this run's: they come from its flags, the rate from the schedule)."""
    buffers = dict(zero.module.named_buffers())
    for key, value in state["model"].items():
        if key in buffers:
            buffers[key].copy_(value)
    saved = state["optim"]["state"]
    for group, names in zip(zero.groups, zero.param_names, strict=True):
        group.refresh()
        entry = optimizer.state[group.master]
        for key, value in saved[optimizer_key(names[0])].items():
            if not _per_element(entry.get(key), group.master):
                entry[key] = value.clone() if isinstance(value, torch.Tensor) else value


def zero_slices(mesh: Mesh, plain_shapes: dict[str, torch.Size]) -> Callable[[str, torch.Tensor], Slices]:
    """How a parameter's flat shards lie on the job: over this rank's dp group, and for a tp shard over
    every tp rank's dp group, each holding its slice of the plain parameter (of ``plain_shapes[name]``)."""
    shape, here = mesh.shape, mesh.coordinates

    def owners(tp_index: int) -> tuple[int, ...]:
        return tuple(shape.rank_of(**{**here, "dp": d, "tp": tp_index}) for d in range(shape.dp))

    def slices_of(name: str, param: torch.Tensor) -> Slices:
        dim = shard_dim(param)
        if dim is None:
            return Slices(owners=(owners(here["tp"]),))
        held = tuple(owners(t) for t in range(shape.tp))
        return Slices(held, mine=here["tp"], whole=tuple(plain_shapes[name]), dim=dim)

    return slices_of


def _per_element(value: Any, master: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == master.numel()
