"""The GPT's parallel plan: how every strategy may cut it, declared beside the model.

:func:`gpt_plan` is the :class:`~meshwise.parallel.plan.ParallelPlan` the strategies read — the blocks
are the repeated layers (pipeline cut points, ZeRO-3 units), the embeddings run first and the final norm
and head last, the head is tied to the token embedding, and :func:`tensor_parallel` is how the model
becomes one rank's tensor-parallel shard. Nothing in :mod:`meshwise.parallel` imports the GPT.

``tensor_parallel(gpt, tp_comm, sequence_parallel=False)`` shards the GPT in place, Megatron style. Every
rank of the tensor-parallel group calls it on the same full model (it is broadcast from the group's
first rank first, so differently seeded ranks still agree); each keeps its slice:

==================  ===================================================================================
``wte`` / ``head``  vocabulary-parallel embedding; the head stays tied to it and produces this rank's
                    slice of the logits (train with :func:`vocab_parallel_cross_entropy`)
``attn.q/k/v``      column parallel: whole heads per rank (``heads/t`` of them); one region entry for
                    the three, so one all-reduce backward instead of three
``attn.out``        row parallel: one all-reduce forward
``mlp.fc/proj``     column / row parallel
``ln*``, ``wpe``,   replicated
row biases
``mlp`` of experts  replicated (a mixture of experts: router and experts whole on every tp rank; their
                    tokens are replicated there, so no sum is needed; ``--ep`` spreads the experts)
==================  ===================================================================================

Under sequence parallelism a mixture of experts takes the whole sequence: its input shards are gathered
(:func:`replicate_sequence`) and its output cut back to this rank's shard (:func:`shard_sequence`), so
every tp rank routes all the tokens of its micro-batch, exactly as without sequence parallelism and as one
process does — the same capacity per forward pass, the same load-balancing loss (a product of means over
the tokens, which shards would each compute over their own), the same router counts — and its
gradients come out whole on every tp rank (no sum over the group: they are left out of the hook below).
The price is that the experts' work is not divided over tp, which it was not without sequence
parallelism either.

Parameter names do not change (``blocks.0.attn.q.weight`` is a shard of the same tensor), so the
shards of a checkpoint map one-to-one onto the full model (:mod:`.shards`).

**Sequence parallelism** (Korthikanti et al., 2022) splits the residual stream along the sequence
between the parallel regions: the embedding's sum becomes a reduce-scatter, every block runs LayerNorm,
dropout and the residual adds on ``s/t`` tokens, enters attention and the MLP with an all-gather and
leaves them with a reduce-scatter; the head gathers the sequence back. The replicated parameters used
on sequence shards (LayerNorms, row-parallel biases, the position table) then see only ``1/t`` of the
tokens, so their gradients are partial: a gradient hook all-reduces each over the group as it is
produced (before accumulation, so gradient accumulation and a data-parallel wrapper stay correct).
Forgetting that sum is the classic sequence-parallel bug; the parity tests catch it.

**Dropout** (:mod:`.rng`): masks agree across the group where activations are replicated and differ
where each rank holds different heads or tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from meshwise.comm.api import Communicator
from meshwise.models.gpt import GPT, MLP, CausalSelfAttention, GPTConfig, language_model_loss
from meshwise.models.moe import MixtureOfExperts
from meshwise.parallel import broadcast_module_state
from meshwise.parallel.plan import ParallelPlan, TensorParallelPlan
from meshwise.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    shard_dim,
    sum_gradient_over,
)
from meshwise.parallel.tensor_parallel.regions import (
    copy_to_region,
    gathered_linears,
    replicate_sequence,
    shard_sequence,
)
from meshwise.parallel.tensor_parallel.rng import RankRandomState, ShardDropout, share_cpu_random_state
from meshwise.parallel.tensor_parallel.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy


def check_tensor_parallel(
    config: GPTConfig, tp: int, *, sequence_parallel: bool = False, seq_len: int | None = None
) -> None:
    """Raise ``ValueError`` saying what to change when ``config`` cannot be split ``tp`` ways.

    Plain arithmetic, so the CLI calls it before starting any rank. ``seq_len`` is the length trained on
    (default: the config's context), which sequence parallelism splits ``tp`` ways. Whether ``tp`` fits
    the number of ranks is the mesh's check (:meth:`~meshwise.comm.mesh.MeshShape.infer`).
    """
    if tp < 1:
        raise ValueError(f"--tp must be at least 1, got {tp}")
    divisors = [d for d in range(1, config.heads + 1) if config.heads % d == 0]
    if config.hidden % tp:
        raise ValueError(
            f"hidden size {config.hidden} is not divisible by --tp {tp}: choose --tp among {divisors}"
        )
    if config.heads % tp:
        raise ValueError(
            f"{config.heads} attention heads do not split across --tp {tp} ranks: "
            f"choose --tp among {divisors}"
        )
    seq_len = config.seq_len if seq_len is None else seq_len
    if sequence_parallel and seq_len % tp:
        raise ValueError(
            f"sequence parallelism splits the sequence of {seq_len} tokens into --tp {tp} shards: "
            f"choose a --seq-len that is a multiple of {tp}"
        )


class ParallelAttention(CausalSelfAttention):
    """Attention over this rank's heads: the parent's math on column-sharded q/k/v and a row-sharded out;
    attention dropout draws from the rank's own random state (its heads are not the others')."""

    def __init__(
        self,
        full: CausalSelfAttention,
        comm: Communicator,
        sequence_parallel: bool,
        random: RankRandomState | None = None,
    ) -> None:
        nn.Module.__init__(self)
        self.head_dim = full.head_dim
        self.dropout = full.dropout
        self.comm = comm
        self.sequence_parallel = sequence_parallel
        self.random = random
        for name in ("q", "k", "v"):
            layer = ColumnParallelLinear.from_linear(getattr(full, name), comm, enter_region=False)
            setattr(self, name, layer)
        self.out = RowParallelLinear.from_linear(full.out, comm, sequence_parallel=sequence_parallel)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.sequence_parallel:
            layers = [(layer.weight, layer.bias) for layer in (self.q, self.k, self.v)]
            q, k, v = gathered_linears(x, self.comm, layers)
            return q, k, v
        return super().project(copy_to_region(x, self.comm))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.random is None or not self.training:
            return super().attend(q, k, v)
        with self.random.active():
            return super().attend(q, k, v)


class ParallelMLP(MLP):
    """The parent's MLP with ``fc`` column parallel and ``proj`` row parallel."""

    def __init__(self, full: MLP, comm: Communicator, sequence_parallel: bool) -> None:
        nn.Module.__init__(self)
        self.fc = ColumnParallelLinear.from_linear(full.fc, comm, sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear.from_linear(full.proj, comm, sequence_parallel=sequence_parallel)


class SequenceShardPositions(nn.Embedding):
    """The full position table, returning the rows of this rank's sequence shard only."""

    def __init__(self, full: nn.Embedding, comm: Communicator) -> None:
        super().__init__(*full.weight.shape, _weight=full.weight.detach().clone())
        self.comm = comm

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return super().forward(positions).chunk(self.comm.world_size, dim=-2)[self.comm.rank]


def tensor_parallel(gpt: GPT, tp_comm: Communicator, *, sequence_parallel: bool = False) -> GPT:
    """Convert ``gpt`` in place into this rank's tensor-parallel shard (see the module docstring).

    The returned model's ``forward(tokens)`` gives this rank's vocabulary slice of the logits:
    ``vocab_parallel_cross_entropy(logits, targets, tp_comm, vocab=gpt.config.vocab)`` is the loss.
    """
    if any(isinstance(block.attn, ParallelAttention) for block in gpt.blocks):
        raise ValueError("this GPT is already tensor parallel")
    check_tensor_parallel(gpt.config, tp_comm.world_size)  # the sequence is checked when it arrives
    broadcast_module_state(gpt, tp_comm)
    sp = sequence_parallel
    random = None
    if gpt.config.dropout > 0:
        share_cpu_random_state(tp_comm)
        random = RankRandomState(tp_comm)
        if sp:
            gpt.drop = ShardDropout(gpt.config.dropout, random)
    gpt.wte = VocabParallelEmbedding.from_embedding(gpt.wte, tp_comm, sequence_parallel=sp)
    gpt.head = ColumnParallelLinear(gpt.wte.weight, None, tp_comm, sequence_parallel=sp)
    if sp:
        gpt.wpe = SequenceShardPositions(gpt.wpe, tp_comm)
    for block in gpt.blocks:
        block.attn = ParallelAttention(block.attn, tp_comm, sp, random)
        if not isinstance(block.mlp, MixtureOfExperts):  # experts stay whole: see the module docstring
            block.mlp = ParallelMLP(block.mlp, tp_comm, sp)
        elif sp:
            on_whole_sequence(block.mlp, tp_comm)
        if random is not None and sp:
            block.dropout = ShardDropout(gpt.config.dropout, random)
    if sp:
        whole = {
            id(p)
            for layer in gpt.modules()
            if isinstance(layer, MixtureOfExperts)
            for p in layer.parameters()
        }
        for param in gpt.parameters():
            if shard_dim(param) is None and id(param) not in whole:
                sum_gradient_over(param, tp_comm)
    return gpt


def on_whole_sequence(layer: nn.Module, tp_comm: Communicator) -> None:
    """Run ``layer`` on the whole sequence under sequence parallelism (see the module docstring): its
    input gathered from the shards, its output cut back to this rank's, by forward hooks (so its
    parameters keep their names)."""
    layer.register_forward_pre_hook(lambda _layer, args: (replicate_sequence(args[0], tp_comm), *args[1:]))
    layer.register_forward_hook(lambda _layer, _args, output: shard_sequence(output, tp_comm))


def gpt_plan(config: GPTConfig) -> ParallelPlan:
    """The plan of a GPT of ``config`` (see the module docstring)."""

    def enter(holder: nn.Module, tokens: torch.Tensor) -> torch.Tensor:  # GPT.embed on a stage's modules
        modules = SimpleNamespace(config=config, wte=holder.wte, wpe=holder.wpe, drop=holder.drop)
        return GPT.embed(modules, tokens)  # type: ignore[arg-type]

    def sharded_loss(
        logits: torch.Tensor, targets: torch.Tensor, comm: Communicator, reduction: str
    ) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, comm, vocab=config.vocab, reduction=reduction)

    def check(tp: int, sequence_parallel: bool, seq_len: int) -> None:
        check_tensor_parallel(config, tp, sequence_parallel=sequence_parallel, seq_len=seq_len)

    return ParallelPlan(
        layers="blocks",
        first=("wte", "wpe", "drop"),
        last=("ln_f", "head"),
        enter=enter,
        leave=GPT.logits,  # type: ignore[arg-type]  # uses only ln_f and head
        loss=language_model_loss,
        activation_shape=lambda tokens: torch.Size([*tokens, config.hidden]),
        tied=(("wte.weight", "head.weight"),),
        tensor_parallel=TensorParallelPlan(
            convert=lambda model, comm, sp: tensor_parallel(model, comm, sequence_parallel=sp),  # type: ignore[arg-type]
            loss=sharded_loss,
            check=check,
        ),
    )
