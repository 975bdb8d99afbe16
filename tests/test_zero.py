"""ZeRO stages 1/2/3 against one process on the full batch, step by step; memory, freeing, prefetch.

One spawn per world size runs the whole matrix (stage × optimizer × variant) and returns the worst
parameter difference of each combination, so a failure names it. The models' sizes divide none of
2, 3, 4, so every run pads.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import meshwise
from meshwise.models.gpt import GPT, GPTConfig, language_model_loss
from meshwise.models.gpt_plan import gpt_plan
from meshwise.parallel.zero import shard, zero_formula
from meshwise.parallel.zero.layout import FlatLayout
from meshwise.parallel.zero.units import ROOT, default_units, plan_stage3
from meshwise.runtime.spawn import spawn

STEPS = 5
PER_RANK = 4
GPT_SMALL = GPTConfig(layers=2, hidden=16, heads=2, seq_len=8, vocab=31)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 10), nn.GELU(), nn.Linear(10, 3))


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _mlp_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(PER_RANK * world_size, 7, generator=generator)
    return x, torch.randn(PER_RANK * world_size, 3, generator=generator)


def _difference(reference: nn.Module, sharded) -> float:
    full = sharded.state_dict()
    return max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())


def _train_pair(
    comm,
    stage: int,
    optimizer: str,
    *,
    micro: int = 1,
    clip: float | None = None,
    precision: str | None = None,
    frozen: bool = False,
) -> float:
    """Worst difference between the sharded model on shards and one process on the full batch."""
    rank, world_size = comm.rank, comm.world_size
    reference = _mlp()
    if frozen:
        reference[2].weight.requires_grad_(False)
    replica = copy.deepcopy(reference)
    if rank != 0:  # sharding must start every rank from rank 0's weights
        with torch.no_grad():
            for p in replica.parameters():
                p.add_(1.0)
    model = shard(replica, comm, stage=stage, mixed_precision=precision, bucket_mb=600 / 2**20)
    ref_opt = _optimizer(optimizer, [p for p in reference.parameters() if p.requires_grad])
    opt = _optimizer(optimizer, model.parameters())
    worst = 0.0
    for step in range(STEPS):
        x, y = _mlp_batch(step, world_size)
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        ref_opt.step()
        opt.zero_grad()
        shard_x, shard_y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        pieces = list(zip(shard_x.chunk(micro), shard_y.chunk(micro), strict=True))
        for i, (mx, my) in enumerate(pieces):
            if i < micro - 1:
                with model.no_sync():
                    (nn.functional.mse_loss(model(mx), my) / micro).backward()
            else:
                (nn.functional.mse_loss(model(mx), my) / micro).backward()
        if clip is not None:
            norm = model.clip_grad_norm_(clip)
            assert norm > clip, "the test must actually clip"
        opt.step()
        worst = max(worst, _difference(reference, model))
    # a fresh sharded model loading the plain model's full state dict computes as the trained one does
    fresh = shard(_mlp(), comm, stage=stage, mixed_precision=precision, bucket_mb=600 / 2**20)
    fresh.load_state_dict(reference.state_dict())
    with torch.no_grad():
        x, _ = _mlp_batch(STEPS, world_size)
        loaded = (fresh(x) - model(x)).abs().max().item()
    return max(worst, _difference(reference, fresh), loaded)


def _train_gpt_pair(comm, stage: int, optimizer: str, prefetch: int = 1, reshard: bool = True) -> float:
    rank, world_size = comm.rank, comm.world_size
    torch.manual_seed(0)
    reference = GPT(GPT_SMALL).double()
    replica = copy.deepcopy(reference)
    model = shard(replica, comm, stage=stage, prefetch=prefetch, reshard_after_forward=reshard)
    ref_opt, opt = _optimizer(optimizer, reference.parameters()), _optimizer(optimizer, model.parameters())
    worst = 0.0
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, GPT_SMALL.vocab, (PER_RANK * world_size, 9), generator=generator)
        x, y = tokens[:, :-1], tokens[:, 1:]
        ref_opt.zero_grad()
        language_model_loss(reference(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        language_model_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
        opt.step()
        worst = max(worst, _difference(reference, model))
    return worst


def _memory(comm) -> dict[str, tuple]:
    """(report, formula) per stage and precision, after one AdamW step on the MLP."""
    results = {}
    for precision, (b_p, b_g, k) in (("fp32", (4, 4, 8)), ("bf16", (2, 2, 12))):
        for stage in (1, 2, 3):
            model = shard(_mlp(), comm, stage=stage, mixed_precision=precision, bucket_mb=600 / 2**20)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            x, y = _mlp_batch(0, comm.world_size)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            report = model.memory_report(opt)
            formula = zero_formula(stage, report.shard_numel, comm.world_size, param_bytes=b_p,
                                   grad_bytes=b_g, k=k)  # fmt: skip
            measured = (report.parameters, report.gradients, report.optimizer_state)
            psi = sum(p.numel() for p in _mlp().parameters())
            results[f"{precision}/stage{stage}"] = (
                measured,
                formula,
                report.shard_numel,
                psi,
                len(model.groups),
            )
    return results


def _matrix() -> dict[str, object]:
    world = meshwise.init("gloo", timeout=60)
    comm = world.comm
    results: dict[str, object] = {}
    for stage in (1, 2, 3):
        for optimizer in ("sgd", "adamw"):
            results[f"mlp/stage{stage}/{optimizer}"] = _train_pair(comm, stage, optimizer)
            if stage == 3:  # GPT units (blocks + a root holding the tied head) are stage 3's business
                results[f"gpt64/stage{stage}/{optimizer}"] = _train_gpt_pair(comm, stage, optimizer)
        results[f"mlp/stage{stage}/adamw/accumulate+clip"] = _train_pair(
            comm, stage, "adamw", micro=2, clip=0.05
        )
        results[f"mlp/stage{stage}/sgd/frozen"] = _train_pair(comm, stage, "sgd", frozen=True)
        results[f"bf16/stage{stage}/sgd"] = _train_pair(comm, stage, "sgd", precision="bf16")
    results["gpt64/stage3/adamw/prefetch0"] = _train_gpt_pair(comm, 3, "adamw", prefetch=0)
    results["gpt64/stage3/adamw/prefetch2"] = _train_gpt_pair(comm, 3, "adamw", prefetch=2)
    results["gpt64/stage3/sgd/keep-after-forward"] = _train_gpt_pair(comm, 3, "sgd", reshard=False)
    results["memory"] = _memory(comm)
    meshwise.shutdown()
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_stage_matches_one_process_after_every_step(world_size):
    for rank, results in enumerate(spawn(_matrix, world_size, timeout=110)):
        memory = results.pop("memory")
        for key, worst in results.items():
            if key.startswith("bf16"):
                # bf16 compute copies round weights and activations to 8 significant bits (relative
                # error 2^-9 ≈ 2e-3); five SGD steps of lr 0.1 on O(1) gradients stay within that order.
                assert 0 < worst < 1e-2, f"rank {rank} {key}: {worst}"
            elif key.startswith("gpt64"):
                assert worst < 1e-12, f"rank {rank} {key}: {worst}"  # float64: reduction order only
            else:
                assert worst < 1e-6, f"rank {rank} {key}: {worst}"
        for key, (measured, formula, shard_numel, psi, groups) in memory.items():
            assert measured == formula, f"rank {rank} {key}: {measured} != {formula}"
            assert psi % world_size and 0 < shard_numel * world_size - psi < groups * world_size, key


# ---------------------------------------------------------------------------------------- stage 3 behaviour
class _Recorder:
    """A Communicator stand-in that notes each all_gather in a shared event list."""

    def __init__(self, comm, events: list[str]) -> None:
        self._comm, self._events = comm, events

    def __getattr__(self, name: str):
        return getattr(self._comm, name)

    def all_gather(self, *args, **kwargs):
        self._events.append("all_gather")
        return self._comm.all_gather(*args, **kwargs)


def _stage3_lifecycle() -> dict[str, object]:
    world = meshwise.init("gloo", timeout=60)
    events: list[str] = []
    torch.manual_seed(0)
    gpt = GPT(GPT_SMALL)
    model = shard(gpt, _Recorder(world.comm, events), stage=3, units=list(gpt.blocks))

    def stored(block) -> int:
        return block.attn.q.weight.untyped_storage().nbytes()

    seen: dict[str, list] = {"forward": [], "backward": []}

    def note(what: str, block=None, kind: str = "") -> None:
        if block is not None:
            seen[kind].append(_whole(block))
        events.append(what)

    for i, block in enumerate(gpt.blocks):
        block.register_forward_pre_hook(lambda *_, i=i: note(f"forward {i}"), prepend=True)
        block.mlp.register_forward_hook(lambda *_, b=block, i=i: note(f"compute end {i}", b, "forward"))
        block.register_full_backward_pre_hook(lambda *_, i=i: note(f"backward {i}"), prepend=True)
        block.mlp.register_full_backward_pre_hook(lambda *_, b=block: note("mlp backward", b, "backward"))
        block.ln1.register_full_backward_hook(lambda *_, i=i: note(f"backward end {i}"))
    tokens = torch.randint(0, GPT_SMALL.vocab, (2, 8))
    loss = language_model_loss(model(tokens), tokens)
    after_forward = [stored(b) for b in gpt.blocks]
    root_during = gpt.wte.weight.untyped_storage().nbytes()
    loss.backward()
    after_backward = [stored(b) for b in gpt.blocks] + [gpt.wte.weight.untyped_storage().nbytes()]
    with torch.no_grad():
        model(tokens)
    after_eval = [stored(b) for b in gpt.blocks] + [gpt.wte.weight.untyped_storage().nbytes()]
    misuse = _optimizer_built_too_early(world.comm)
    meshwise.shutdown()
    return {
        "events": events, "seen": seen, "after_forward": after_forward, "root_during": root_during,
        "after_backward": after_backward, "after_eval": after_eval, "misuse": misuse,
    }  # fmt: skip


def _optimizer_built_too_early(comm) -> tuple[str, bool, str]:
    """An optimizer on the plain parameters is refused at its first step, before changing anything."""
    plain = _mlp()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    model = shard(plain, comm, stage=2)
    before = model.state_dict()
    nn.functional.mse_loss(model(torch.ones(2, 7)), torch.zeros(2, 3)).backward()
    error = ""
    try:
        optimizer.step()
    except RuntimeError as exc:
        error = str(exc)
    after = model.state_dict()
    again = ""
    try:
        shard(plain, comm, stage=3)
    except ValueError as exc:
        again = str(exc)
    return error, all(torch.equal(before[k], after[k]) for k in before), again


def _whole(block: nn.Module) -> bool:
    """Whether every parameter of ``block`` has its full storage right now."""
    return all(p.untyped_storage().nbytes() >= p.numel() * p.element_size() for p in block.parameters())


def test_stage3_frees_gathered_units_and_prefetches_the_next_one():
    result = spawn(_stage3_lifecycle, 2, timeout=60)[0]
    # gathered whenever they compute: two forwards (training, evaluation) and one backward per block
    assert result["seen"]["forward"] == [True] * 4 and result["seen"]["backward"] == [True] * 2
    assert result["after_forward"] == [0, 0], "blocks must be freed after their forward"
    assert result["root_during"] > 0, "the root stays gathered until backward ends"
    assert result["after_backward"] == [0, 0, 0] and result["after_eval"] == [0, 0, 0]
    error, unchanged, again = result["misuse"]
    assert "build the optimizer after shard()" in error and "'0.weight'" in error and unchanged, error
    assert "already belongs to a sharded model" in again
    events = result["events"]
    # forward: block 0's own gather, then block 1's, both before block 0's compute ends
    start, end = events.index("forward 0"), events.index("compute end 0")
    assert events[start:end].count("all_gather") == 2, events
    # backward: block 1 is gathered again and block 0's gather starts before block 1's backward ends
    start, end = events.index("backward 1"), events.index("backward end 1")
    assert events[start:end].count("all_gather") == 2, events


# -------------------------------------------------------------------------------------------- plain data
def test_flat_layout_pads_and_pieces_cover_every_element_once():
    layout = FlatLayout((5, 3, 7), 4)
    assert (layout.numel, layout.shard_numel, layout.padded_numel) == (15, 4, 16)
    covered = []
    for rank in range(4):
        for piece in layout.pieces(rank):
            start = layout.offsets[piece.param] + piece.param_start
            assert layout.shard_range(rank)[0] + piece.shard_start == start
            covered.extend(range(start, start + piece.numel))
    assert covered == list(range(15))
    assert FlatLayout((2,), 4).shard_numel == 1 and FlatLayout((2,), 4).pieces(3) == []


def test_gpt_units_are_blocks_and_the_tied_head_lives_in_the_root():
    gpt = GPT(GPT_SMALL)
    units = gpt_plan(gpt.config).layer_modules(gpt)
    assert units == list(gpt.blocks)
    assert default_units(gpt)[:2] == [gpt.wte, gpt.wpe]  # without a plan: every parameter-holding child
    plans = plan_stage3(gpt, units)
    assert [p.unit for p in plans] == [2, 1, ROOT]  # gradient-ready order: last block first
    assert "wte.weight" in plans[-1].names and not any("head" in n for p in plans for n in p.names)
    shared = nn.Linear(2, 2)
    model = nn.Sequential(nn.Sequential(shared), nn.Sequential(shared), nn.Linear(2, 2))
    plans = plan_stage3(model, [model[0], model[1]])
    assert [n for p in plans if p.unit == ROOT for n in p.names] == [
        "0.0.weight",
        "0.0.bias",
        "2.weight",
        "2.bias",
    ]


def test_zero_formula_is_the_paper_table():
    psi, n = 7_500_000_000, 64
    shard_numel = psi // n
    bytes_ = [sum(zero_formula(s, shard_numel, n, param_bytes=2, grad_bytes=2, k=12)) for s in range(4)]
    assert bytes_ == [16 * psi, 4 * psi + 12 * psi // n, 2 * psi + 14 * psi // n, 16 * psi // n]
    assert bytes_[0] == 120_000_000_000  # the 7.5B model: 120 GB per GPU with DDP


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"stage": 0}, ValueError, "not a ZeRO stage"),
        ({"stage": 4}, ValueError, "not a ZeRO stage"),
        ({"stage": 3, "prefetch": -1}, ValueError, "prefetch"),
        ({"stage": 2, "units": []}, ValueError, "only apply to stage 3"),
        ({"stage": 3, "mixed_precision": "fp8"}, ValueError, "unknown"),
        ({"stage": 3, "bucket_mb": 0}, ValueError, "positive"),
    ],
)
def test_bad_arguments_fail_before_any_communication(kwargs, error, match):
    with pytest.raises(error, match=match):
        shard(_mlp(), comm=None, **kwargs)  # no world exists: the check must come first
