"""ZeRO's state dict under the plain model's names, through DCP: save on 4 ranks (stage 3), continue on 2
(stage 2, flat groups of other sizes) and on 1 (stage 1), and read it into the plain model with torch alone.

Each rank writes only its shards (:func:`~meshwise.parallel.zero.state_dict.zero_held` describes them to
:func:`~meshwise.parallel.state_dict.sharded_state_dict`, whose tensors are views of them); loading asks
for the ranges the new layout needs. The model is float64, so runs over
different world sizes differ only by reduction order (≈1e-16) and "the same losses" can be checked tightly.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import meshwise
from meshwise.models.gpt import GPT, GPTConfig, language_model_loss
from meshwise.parallel.state_dict import finish_load, sharded_state_dict
from meshwise.parallel.zero import shard
from meshwise.parallel.zero.state_dict import zero_held, zero_layout
from meshwise.runtime.spawn import spawn

CONFIG = GPTConfig(layers=2, hidden=16, heads=2, seq_len=8, vocab=29)
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks
SAVED_AT, TOTAL = 3, 5


def _gpt(config: GPTConfig = CONFIG) -> GPT:
    torch.manual_seed(0)
    return GPT(config).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CONFIG.vocab, (GLOBAL_BATCH, 9), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def _step(model, optimizer, comm, step: int) -> float:
    """One training step on this rank's share of the global batch; returns the global mean loss."""
    x, y = _batch(step)
    rank, world = comm.rank, comm.world_size
    optimizer.zero_grad()
    loss = language_model_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank])
    loss.backward()
    optimizer.step()
    total = loss.detach().reshape(1).clone()
    comm.all_reduce(total, "avg")
    return total.item()


def zero_state_dict(model, optimizer) -> dict:
    """The checkpoint state of a ZeRO model not cut by any other strategy."""
    return sharded_state_dict(zero_held(model), optimizer, model.module, zero_layout(model, optimizer))


def _first_run(directory: str) -> list[float]:
    """4 ranks, stage 3: train, checkpoint after SAVED_AT steps, keep going to TOTAL (uninterrupted)."""
    comm = meshwise.init("gloo", timeout=60).comm
    model = shard(_gpt(), comm, stage=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = [_step(model, optimizer, comm, s) for s in range(SAVED_AT)]
    dcp.save(zero_state_dict(model, optimizer), checkpoint_id=os.path.join(directory, "ckpt"))
    losses += [_step(model, optimizer, comm, s) for s in range(SAVED_AT, TOTAL)]
    meshwise.shutdown()
    return losses


def _resume(directory: str, stage: int) -> list[float]:
    comm = meshwise.init("gloo", timeout=60).comm
    small = {} if stage == 3 else {"bucket_mb": 0.01, "first_bucket_mb": 0.01}  # groups of unequal sizes
    model = shard(_gpt(), comm, stage=stage, **small)
    assert len({g.layout.numel for g in model.groups}) > 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = zero_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=os.path.join(directory, "ckpt"))
    finish_load(zero_held(model))
    losses = [_step(model, optimizer, comm, s) for s in range(SAVED_AT, TOTAL)]
    meshwise.shutdown()
    return losses


@pytest.mark.slow
def test_a_checkpoint_from_4_ranks_continues_on_2_and_on_1_with_the_same_losses(tmp_path):
    directory = str(tmp_path)
    uninterrupted = spawn(_first_run, 4, (directory,), timeout=110)[0][SAVED_AT:]
    for ranks, stage in ((2, 2), (1, 1)):
        resumed = spawn(_resume, ranks, (directory, stage), timeout=110)[0]
        assert resumed == pytest.approx(uninterrupted, abs=1e-12), (ranks, stage)
    # torch alone reads it into the plain model (every name and shape: strict), and the plain model's
    # loss before continuing is the first continued step's loss (same weights)
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "plain.pt")
    saved = torch.load(tmp_path / "plain.pt", weights_only=False)
    plain = _gpt()
    plain.load_state_dict(saved["model"])
    assert set(saved["optim"]["state"]) == {n for n, _ in plain.named_parameters()}
    x, y = _batch(SAVED_AT)
    with torch.no_grad():
        assert language_model_loss(plain(x), y).item() == pytest.approx(uninterrupted[0], abs=1e-12)


def _save_and_load_warning_free(directory: str) -> dict[str, object]:
    """ZeRO-3 over 2 ranks of a small CNN (4-D weights whose flat ranges cut mid-row): save, scramble the
    shards, load back — recording every warning torch raises on the way."""
    comm = meshwise.init("gloo", timeout=60).comm
    try:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 5))
        model = shard(net, comm, stage=3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(4, 2, 6, 6)).square().mean().backward()
        optimizer.step()
        saved = [(g.master.clone(), optimizer.state[g.master]["exp_avg"].clone()) for g in model.groups]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = zero_state_dict(model, optimizer)
            dcp.save(state, checkpoint_id=directory)
            for group in model.groups:
                group.master.data.normal_()
                optimizer.state[group.master]["exp_avg"].zero_()
            loaded = zero_state_dict(model, optimizer)
            dcp.load(loaded, checkpoint_id=directory)
            finish_load(zero_held(model))
        restored = all(  # every element but the padding, which is never written
            torch.equal(g.master[p], master[p])
            and torch.equal(optimizer.state[g.master]["exp_avg"][p], moment[p])
            for g, (master, moment) in zip(model.groups, saved, strict=True)
            for p in (slice(q.shard_start, q.shard_start + q.numel) for q in g.layout.pieces(comm.rank))
        )
        kinds = {type(v).__name__ for v in state["model"].values()}
        kinds |= {type(v).__name__ for slots in state["optim"]["state"].values() for v in slots.values()}
        return {
            "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
            "restored": restored,
            "kinds": kinds,
            "weights": {k: tuple(v.shape) for k, v in net.state_dict().items()},
        }
    finally:
        meshwise.shutdown()


def test_a_zero_checkpoint_is_dtensors_saved_and_loaded_without_a_deprecation_warning(tmp_path):
    """No ``ShardedTensor`` (deprecated: torch warns on every save and load): DTensors, read back
    exactly, and torch alone turns the checkpoint into the plain CNN's state dict."""
    found = spawn(_save_and_load_warning_free, 2, (str(tmp_path / "ckpt"),), timeout=60)
    for rank in found:
        assert not [w for w in rank["warnings"] if "FutureWarning" in w or "ShardedTensor" in w], rank
        assert rank["restored"], rank
        assert rank["kinds"] == {"DTensor", "Tensor"}, rank  # moments and weights; AdamW's step a Tensor
    dcp_to_torch_save(tmp_path / "ckpt", tmp_path / "plain.pt")
    saved = torch.load(tmp_path / "plain.pt", weights_only=False)
    assert {k: tuple(v.shape) for k, v in saved["model"].items()} == found[0]["weights"]
