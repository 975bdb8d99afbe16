"""``shard(model, comm, stage=1|2|3)``: ZeRO / FSDP-style sharded data parallelism behind one wrapper.

Usage is DataParallel's, with the optimizer built *after* wrapping, on the wrapper's parameters — which
are this rank's float32 master shards, one per flat group::

    model = shard(model, stage=3, mixed_precision="bf16")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)   # sees 1/N of the parameters
    loss_fn(model(x_shard), y_shard).backward()
    model.clip_grad_norm_(1.0)                                  # global norm, over every shard
    optimizer.step()                                            # then updated shards are re-gathered

Any ``torch.optim`` optimizer works because it only ever sees ordinary parameters (the shards) with
ordinary gradients: optimizer-step hooks, registered once when this module is imported, hand each shard
its reduced gradient just before the step and, just after it, push the updated shard to the compute
copies (stages 1/2 all-gather it; stage 3 gathers it when the unit next runs). An optimizer that still
holds the original, unsharded parameters is refused at its first step, before it changes anything.

ZeRO shards what is replicated over the ranks that replicate it: under expert parallelism (``experts``)
a rank's experts are equal only on ``experts.comm`` (dp·cp; the other ep ranks hold other experts), so
they get flat groups of their own, started from that group's first rank and reduced, gathered and
checkpointed over it, each local gradient multiplied by 1/ep as it is accumulated (the combine's backward
all-to-all already summed the ep ranks' tokens into it). The gradient norm stays one sum over ``comm``:
the ranks of ``comm`` outside ``experts.comm`` hold other experts, so each element counts once.
``state_dict()``/``load_state_dict()`` speak the plain model's full state dict (collective); the sharded
one DCP writes is :mod:`meshwise.parallel.zero.state_dict`'s.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._pytree import tree_map_only

from meshwise.comm.api import Communicator, ReduceOp
from meshwise.parallel.data_parallel.buckets import MIB
from meshwise.parallel.data_parallel.data import broadcast_tensors
from meshwise.parallel.expert_parallel.placement import ExpertReplicas, is_expert_parameter
from meshwise.parallel.zero.flat import FlatGroup, Tracker
from meshwise.parallel.zero.grads import GradientSync
from meshwise.parallel.zero.memory import MemoryReport, measure
from meshwise.parallel.zero.precision import MixedPrecision
from meshwise.parallel.zero.schedule import UnitSchedule
from meshwise.parallel.zero.units import ROOT, SeparateBy, default_units, plan_buckets_as_groups, plan_stage3
from meshwise.world import current_world

OWNER = "_meshwise_zero_owner"  # on a master shard: (weakref to its ShardedModel, group index)
ORIGINAL = "_meshwise_zero_sharded"  # on a module parameter taken over by shard(): its name


class ShardedModel(nn.Module):
    """``module`` with its parameters, gradients and optimizer state sharded over ``comm`` (default: the
    world's; pass a mesh axis such as ``mesh.dp``).

    ``stage`` 1 shards optimizer state, 2 also gradients, 3 also parameters (gathered per unit: ``units``
    — a model's plan gives its layers, ``plan.layer_modules(model)`` — or :func:`default_units`).
    ``mixed_precision``: ``None``/``"fp32"``, ``"bf16"``, ``"fp16"`` or a :class:`MixedPrecision`.
    ``prefetch``: how many units ahead stage 3 starts gathering. ``bucket_mb``/``first_bucket_mb``:
    stages 1/2 group sizes (DataParallel's buckets). ``separate_by(name, param)``: parameters with
    different keys get different flat groups (see :meth:`parameters_where`). ``experts``: an
    expert-parallel model's experts, sharded over their own replicas (the module docstring). Every
    argument is checked before any communication.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator | None = None,
        *,
        stage: int = 3,
        mixed_precision: MixedPrecision | str | None = None,
        units: Sequence[nn.Module] | None = None,
        reshard_after_forward: bool = True,
        prefetch: int = 1,
        bucket_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        separate_by: SeparateBy | None = None,
        experts: ExpertReplicas | None = None,
    ) -> None:
        if isinstance(stage, bool) or stage not in (1, 2, 3):
            raise ValueError(
                f"stage={stage!r} is not a ZeRO stage: use 1 (optimizer state), 2 (+ gradients) "
                "or 3 (+ parameters); for plain data parallelism use DataParallel"
            )
        if not isinstance(module, nn.Module):
            raise TypeError(f"shard() takes an nn.Module, got {type(module).__name__}")
        if isinstance(module, ShardedModel):
            raise ValueError("this model is already sharded; shard the plain model once")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be a whole number of units ≥ 0, got {prefetch!r}")
        if not (bucket_mb > 0 and first_bucket_mb > 0):
            raise ValueError(f"bucket sizes must be positive MiB, got {bucket_mb} and {first_bucket_mb}")
        if units is not None and stage != 3:
            raise ValueError(f"units only apply to stage 3 (stage {stage} keeps every parameter gathered)")
        precision = MixedPrecision.parse(mixed_precision)
        comm = comm if comm is not None else current_world().comm
        super().__init__()
        named = dict(module.named_parameters())
        _check_parameters(named, precision)
        self.module = module
        self.comm = comm
        self.stage = stage
        self.precision = precision
        self.tracker = Tracker()
        #: the ranks each kind of parameter is replicated over: 0, ``comm``; 1, the experts'
        self.replica_comms = [comm] if experts is None else [comm, experts.comm]
        replica_of = {name: int(experts is not None and is_expert_parameter(name)) for name in named}
        grad_scales = (1.0, 1 / experts.ep if experts is not None else 1.0)

        def separate(name: str, param: nn.Parameter) -> tuple[int, Any]:
            """Never one flat group over two kinds of replicas (nor two of the caller's kinds)."""
            return replica_of[name], separate_by(name, param) if separate_by is not None else None

        if stage == 3:
            chosen = list(units) if units is not None else default_units(module)
            plans = plan_stage3(module, chosen, separate)
        else:
            bucket, first = round(bucket_mb * MIB), round(first_bucket_mb * MIB)
            plans = plan_buckets_as_groups(module, bucket, first, separate)
        # every rank starts from its replicas' first rank's weights (buffers: the model's)
        members: list[list[torch.Tensor]] = [[] for _ in self.replica_comms]
        for name, param in named.items():
            members[replica_of[name]].append(param)
        members[0] += list(module.buffers())
        for replicas, tensors in zip(self.replica_comms, members, strict=True):
            broadcast_tensors(tensors, replicas)
        self.groups: list[FlatGroup] = []
        #: each flat group's replicas (an index into :attr:`replica_comms`: 1 for the experts)
        self.replica_of = [replica_of[plan.names[0]] for plan in plans]
        for index, plan in enumerate(plans):
            params = [named[name] for name in plan.names]
            first = params[0]
            of = self.replica_of[index]
            compute = precision.param_dtype if precision else first.dtype
            grad = precision.gradient_dtype if precision else first.dtype
            group = FlatGroup(
                f"shard{index}", params, self.replica_comms[of], compute_dtype=compute, grad_dtype=grad,
                stage=stage, tracker=self.tracker, grad_scale=grad_scales[of],
            )  # fmt: skip
            setattr(group.master, OWNER, (weakref.ref(self), index))
            for name, param in zip(plan.names, params, strict=True):
                setattr(param, ORIGINAL, name)
            self.groups.append(group)
        self.param_names = [plan.names for plan in plans]
        unit_of = [plan.unit for plan in plans]
        self.schedule: UnitSchedule | None = None
        if stage == 3:
            self.schedule = UnitSchedule(
                chosen, self.groups, unit_of, prefetch=prefetch, reshard_after_forward=reshard_after_forward,
                on_backward_start=lambda: self._grads.ensure_callback(),
            )  # fmt: skip
        else:
            _wait_before_use(module, self.groups)
        self._grads = GradientSync(self.groups, unit_of=unit_of, schedule=self.schedule)

    # ------------------------------------------------------------------ parameters the optimizer sees
    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's master shards (frozen groups' shards have ``requires_grad=False``)."""
        for group in self.groups:
            yield (f"{prefix}.{group.name}" if prefix else group.name), group.master

    def parameters_where(self, keep: SeparateBy) -> list[nn.Parameter]:
        """The master shards of the groups whose first parameter ``keep(name, param)`` accepts — one
        optimizer param group's worth when ``shard(separate_by=keep)`` kept the kinds apart."""
        return [
            group.master
            for group, names in zip(self.groups, self.param_names, strict=True)
            if keep(names[0], group.params[0])
        ]

    # ------------------------------------------------------------------ forward / backward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.schedule is not None:
            self.schedule.gather(ROOT)
        if self.precision is not None:
            args, kwargs = _cast((args, kwargs), self.precision.param_dtype)
        output = self.module(*args, **kwargs)
        if self.schedule is not None and not torch.is_grad_enabled():
            self.schedule.free_all()
        if self.precision is not None:
            output = _cast(output, self.precision.output_dtype)
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate unsharded gradients locally; the next synchronised one
        reduce-scatters the sum (stage 1 also reduces what is left when the optimizer steps)."""
        previous, self._grads.sync = self._grads.sync, False
        try:
            yield
        finally:
            self._grads.sync = previous

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Stage 3: every unit's parameters gathered for the whole block (a pipeline stage's step, whose
        micro-batches alternate forward and backward on the same units) and freed at its end. The root's
        gathers are awaited here, each unit's by its forward hook, so they overlap the first forwards."""
        if self.schedule is None:
            self.wait_gathered()  # the all-gathers of the last step's update land first
            yield
            return
        self.schedule.holding = True
        try:
            for group in self.groups:
                group.gather()
            self.schedule.gather(ROOT)
            yield
        finally:
            self.schedule.holding = False
            self.schedule.free_all()

    def wait_gathered(self) -> None:
        """Wait for every all-gather in flight: inside :meth:`gathered`, before reading the parameters
        without a forward (whose hooks would wait unit by unit)."""
        for group in self.groups:
            group.wait_gathered()

    # ------------------------------------------------------------------ around the optimizer step
    def before_step(self, groups: Sequence[FlatGroup]) -> None:
        for group in groups:  # an all-gather still reading a slot must land before the slot changes
            group.wait_gathered()
        self._grads.reduce_for_step(groups)
        for group in groups:
            group.expose_gradient()

    def after_step(self, groups: Sequence[FlatGroup]) -> None:
        for group in groups:
            group.release_gradient()
        for group in groups:
            group.refresh()

    @torch.no_grad()
    def unscale_gradients_(self, inv_scale: float, agree: Communicator) -> bool:
        """Loss scaling: hand every reduced gradient shard to the optimizer in float32, multiplied by
        ``inv_scale``, before clipping sees it (float16 shards would flush small unscaled values to zero).
        Returns whether any rank of ``agree`` found an inf or nan: then every rank forgot its gradients,
        so the optimizer finds none and changes neither parameters nor its state."""
        self._grads.reduce_for_step(self.groups)
        found = torch.zeros(1, device=self.groups[0].device)
        for group in self.groups:
            grad = group.expose_gradient(float32=True)
            if grad is not None:
                grad.mul_(torch.tensor(inv_scale, dtype=torch.float32, device=grad.device))
                found = torch.maximum(found, (~torch.isfinite(grad).all()).float())
        agree.all_reduce(found, ReduceOp.MAX)
        if found.item() > 0:
            for group in self.groups:
                group.release_gradient()
        return bool(found.item() > 0)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` of the plain model, on the shards; returns the norm
        (``max_norm=math.inf`` only measures). One reduction over ``comm`` counts every element once, the
        experts' too (the module docstring)."""
        if norm_type not in (2.0, math.inf):
            raise ValueError(f"norm_type must be 2.0 or math.inf, got {norm_type}")
        pending = self.gradient_shards()
        shards = [grad.float() for grad in pending if grad is not None]
        device = self.groups[0].device
        if norm_type == math.inf:
            local = max((s.abs().max() for s in shards), default=torch.zeros((), device=device))
            total = local.reshape(1).clone()
            self.comm.all_reduce(total, ReduceOp.MAX)
        else:
            total = sum((s.square().sum() for s in shards), torch.zeros((), device=device)).reshape(1)
            self.comm.all_reduce(total, ReduceOp.SUM)
            total = total.sqrt()
        if max_norm == math.inf:
            return total.reshape(())
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in pending:
            if grad is not None:
                grad.mul_(coefficient.to(grad.dtype))
        return total.reshape(())

    def reduce_accumulated(self) -> None:
        """Reduce-scatter the gradients backward passes under :meth:`no_sync` accumulated (stages 1/2)."""
        self._grads.reduce_accumulated(self.groups)

    def unsharded_gradient(self, param: torch.Tensor) -> torch.Tensor:
        """The view of ``param``'s accumulated, not yet reduced gradient in its group's flat buffer
        (stages 1/2, under :meth:`no_sync`): where a pipeline sums its tied copies before the reduce."""
        for group in self.groups:
            for index, held in enumerate(group.params):
                if held is param:
                    offset = group.layout.offsets[index]
                    return group.unsharded_gradient()[offset : offset + param.numel()].view(param.shape)
        raise KeyError("not a parameter of this sharded model")

    def gradient_shards(self) -> list[torch.Tensor | None]:
        """Each group's reduced gradient shard the next step will use (None: no gradient), after stage 1
        reduced what ``no_sync`` left; scaling them in place clips (a caller's own global norm, e.g.
        over a mesh where the shards are also tensor-parallel shards)."""
        self._grads.reduce_for_step(self.groups)
        return [g.pending_gradient() for g in self.groups]

    # ------------------------------------------------------------------ state
    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
        """Per-rank bytes of parameters, gradients, optimizer state and the peak of gathered buffers."""
        return measure(self, optimizer)

    @torch.no_grad()
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The plain model's full state dict in its own dtypes (collective: call it on every rank)."""
        values: dict[int, torch.Tensor] = {}
        for group in self.groups:
            flat = torch.empty(group.layout.padded_numel, dtype=group.master.dtype, device=group.device)
            group.comm.all_gather(flat, group.master.detach().contiguous())
            for param, offset in zip(group.params, group.layout.offsets, strict=True):
                values[id(param)] = flat[offset : offset + param.numel()].view(param.shape).clone()
        state = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            state[key] = values[id(value)] if id(value) in values else value.detach().clone()
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):  # type: ignore[override]
        """Load a plain model's full state dict (every rank passes the same one)."""
        targets = self.module.state_dict(keep_vars=True)
        missing = sorted(set(targets) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(targets))
        if strict and (missing or unexpected):
            raise KeyError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}")
        for key, target in targets.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(
                    f"{key}: checkpoint shape {tuple(value.shape)} != model {tuple(target.shape)}"
                )
            if not isinstance(target, nn.Parameter):
                target.copy_(value)
        for group, names in zip(self.groups, self.param_names, strict=True):
            start, end = group.layout.shard_range(group.comm.rank)
            flat = torch.zeros(group.layout.padded_numel, dtype=group.master.dtype, device=group.device)
            for name, offset, numel in zip(names, group.layout.offsets, group.layout.numels, strict=True):
                flat[offset : offset + numel].copy_(state_dict[name].reshape(-1))
            group.wait_gathered()
            group.master.copy_(flat[start:end])
            group.refresh()  # the compute copies: all-gathered (stages 1/2) or the compute shard (3)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)


#: the name the docs and callers use: wrapping a model is sharding it
shard = ShardedModel


def _check_parameters(named: Mapping[str, nn.Parameter], precision: MixedPrecision | None) -> None:
    if not named:
        raise ValueError("the model has no parameters: there is nothing to shard")
    for name, param in named.items():
        if hasattr(param, ORIGINAL):
            raise ValueError(f"parameter {name!r} already belongs to a sharded model; shard a fresh model")
        if not param.dtype.is_floating_point:
            raise ValueError(f"parameter {name!r} has dtype {param.dtype}; only floating parameters shard")
        if precision is not None and param.dtype != torch.float32:
            raise ValueError(
                f"mixed precision keeps float32 master weights, but {name!r} is {param.dtype}: "
                "build the model in float32 (mixed_precision casts the compute copies itself)"
            )


def _wait_before_use(module: nn.Module, groups: Sequence[FlatGroup]) -> None:
    """Stages 1/2: forward pre-hooks that wait, module by module, for the all-gathers started after the
    last step, so the gather of later layers overlaps the forward of earlier ones."""
    group_of = {id(param): group for group in groups for param in group.params}
    for sub in module.modules():
        needed = list({id(group_of[id(p)]): group_of[id(p)] for p in sub.parameters(recurse=False)}.values())
        if needed:
            sub.register_forward_pre_hook(partial(_wait, needed))


def _wait(groups: list[FlatGroup], _module: nn.Module, _args: Any) -> None:
    for group in groups:
        group.wait_gathered()


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """Floating tensors anywhere in ``value`` (nested tuples/lists/dicts) cast to ``dtype``."""
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, value)


def _sharded_groups(optimizer: torch.optim.Optimizer) -> list[tuple[ShardedModel, list[FlatGroup]]]:
    """The sharded models whose shards ``optimizer`` holds, each with those groups (in group order)."""
    found: dict[int, tuple[ShardedModel, set[int]]] = {}
    for param_group in optimizer.param_groups:
        for param in param_group["params"]:
            owner = getattr(param, OWNER, None)
            if owner is None:
                name = getattr(param, ORIGINAL, None)
                if name is not None:
                    raise RuntimeError(
                        f"{type(optimizer).__name__} holds the unsharded parameter {name!r} of a model that "
                        "was sharded: build the optimizer after shard(), on the sharded model's "
                        "parameters, e.g. torch.optim.AdamW(sharded.parameters(), ...)"
                    )
                continue
            model = owner[0]()
            if model is not None:
                found.setdefault(id(model), (model, set()))[1].add(owner[1])
    return [(model, [model.groups[i] for i in sorted(indices)]) for model, indices in found.values()]


def _pre_step(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    for model, groups in _sharded_groups(optimizer):
        model.before_step(groups)


def _post_step(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    for model, groups in _sharded_groups(optimizer):
        model.after_step(groups)


_HOOKS = (register_optimizer_step_pre_hook(_pre_step), register_optimizer_step_post_hook(_post_step))
