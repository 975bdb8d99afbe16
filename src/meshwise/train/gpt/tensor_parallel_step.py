"""``meshwise train gpt --tp T [--sp]``: tensor (and sequence) parallelism inside ``mesh.tp``, data
parallelism across ``mesh.dp``.

The model is cut in place by :func:`~meshwise.parallel.tensor_parallel.tensor_parallel` from the full
model every rank built from the same seed, so a tp run starts where a one-process run starts; the loss is
the vocabulary-parallel cross-entropy (logits are never gathered). What the seam's contract asks of a
sharded strategy, and how it is met here:

- the gradient norm for clipping is the whole model's: squares of the shards are summed over ``mesh.tp``,
  replicated parameters (identical on every tp rank) counted once;
- checkpoints hold full tensors under the plain model's names, model and AdamW state alike (gathered
  from the shards, vocabulary padding removed), so a tp checkpoint has the layout of a data-parallel one
  and each rank takes its slices back on load;
- ``full_model()`` reassembles a plain GPT: it is collective over ``mesh.tp``, so every rank calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from meshwise.comm.mesh import Mesh
from meshwise.models.gpt import GPT
from meshwise.models.gpt_plan import gpt_plan, tensor_parallel
from meshwise.parallel import DataParallel
from meshwise.parallel.tensor_parallel import full_tensors
from meshwise.parallel.tensor_parallel import vocab_parallel_cross_entropy as parallel_loss
from meshwise.parallel.tensor_parallel.shards import gather_full, local_shard
from meshwise.train.gpt.config import GPTTrainConfig
from meshwise.train.gpt.parallelize import Batch, ParallelStep, build_optimizer, init_optimizer_state


class TensorParallelStep(ParallelStep):
    """This rank's shard of the model, AdamW over the shard, DataParallel over ``mesh.dp``."""

    def __init__(self, model: GPT, mesh: Mesh, config: GPTTrainConfig) -> None:
        super().__init__(config, mesh, next(model.parameters()).device)
        self.tp = mesh.tp
        self.config = model.config
        self.local = tensor_parallel(model, mesh.tp, sequence_parallel=config.sp)
        self.model = DataParallel(self.local, mesh.dp)
        self.optimizer = build_optimizer(self.local, config)
        self.place(self.local.named_parameters())

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        with self.autocast():
            logits = self.model(inputs) if reduction == "mean" else self.local(inputs)
        return parallel_loss(logits.float(), targets, self.tp, vocab=self.config.vocab, reduction=reduction)

    def forward_backward(self, micro_batches: Sequence[Batch]) -> float:
        return self.accumulate_gradients(micro_batches, self._loss)

    @torch.no_grad()
    def eval_loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._loss(inputs, targets, reduction="sum")

    def full_model(self) -> GPT:
        full = GPT(self.config).to(self.device)
        full.load_state_dict(full_tensors(self.local, self.tp), strict=False)  # the tied head is wte
        return full

    def state_dict(self) -> dict[str, Any]:
        init_optimizer_state(self.optimizer)
        names = {param: name for name, param in self.local.named_parameters()}
        model = full_tensors(self.local, self.tp)
        state = {
            names[param]: {
                key: gather_full(value, param, self.tp, model[names[param]].shape)
                if isinstance(value, torch.Tensor) and value.shape == param.shape
                else value
                for key, value in entry.items()
            }
            for param, entry in self.optimizer.state.items()
        }
        groups = [
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [names[p] for p in group["params"]],
            }
            for group in self.optimizer.param_groups
        ]
        for first, copy in gpt_plan(self.config).tied:  # the plain model's state names both keys
            model.setdefault(copy, model[first])
        return {"model": model, "optim": {"state": state, "param_groups": groups}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        named = dict(self.local.named_parameters())
        with torch.no_grad():
            for name, param in named.items():
                param.copy_(local_shard(state["model"][name], param, self.tp))
        # AdamW's slots by name, into this optimizer's own order (a checkpoint of another layout — ZeRO's
        # groups, say — lists its parameters in another one); the hyper-parameters stay this run's
        names = {id(param): name for name, param in named.items()}
        order = [names[id(p)] for group in self.optimizer.param_groups for p in group["params"]]
        slots = {
            i: {
                key: local_shard(value, named[name], self.tp)
                if isinstance(value, torch.Tensor) and value.dim() > 0
                else value
                for key, value in state["optim"]["state"][name].items()
            }
            for i, name in enumerate(order)
        }
        groups = self.optimizer.state_dict()["param_groups"]
        self.optimizer.load_state_dict({"state": slots, "param_groups": groups})
