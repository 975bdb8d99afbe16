"""Sharded checkpoints: save on 4 ranks (stage 3), continue on 2 (stage 2) and on 1, into a plain model.

The model is float64, so runs over different world sizes differ only by reduction order (≈1e-16) and
"the same losses" can be checked tightly.
"""

from __future__ import annotations

import os

import pytest
import torch

import meshwise
from meshwise.models.gpt import GPT, GPTConfig, language_model_loss
from meshwise.parallel.zero import shard
from meshwise.parallel.zero.checkpoint import export_full, load_sharded, load_unsharded, save_sharded
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


def _first_run(directory: str) -> dict[str, object]:
    """4 ranks, stage 3: train, checkpoint after SAVED_AT steps, keep going to TOTAL (uninterrupted)."""
    comm = meshwise.init("gloo", timeout=60).comm
    model = shard(_gpt(), comm, stage=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = [_step(model, optimizer, comm, s) for s in range(SAVED_AT)]
    save_sharded(model, optimizer, os.path.join(directory, "ckpt"))
    export_full(model, os.path.join(directory, "full.pt"))
    files = sorted(os.listdir(os.path.join(directory, "ckpt")))
    stamps = {f: os.stat(os.path.join(directory, "ckpt", f)).st_mtime_ns for f in files}
    refused = ""
    try:  # saving over an existing checkpoint is refused and changes nothing
        save_sharded(model, optimizer, os.path.join(directory, "ckpt"))
    except FileExistsError as exc:
        refused = str(exc)
    unchanged = stamps == {f: os.stat(os.path.join(directory, "ckpt", f)).st_mtime_ns for f in files}
    losses += [_step(model, optimizer, comm, s) for s in range(SAVED_AT, TOTAL)]
    meshwise.shutdown()
    return {"losses": losses, "refused": refused, "unchanged": unchanged}


def _resume(directory: str, stage: int) -> dict[str, object]:
    comm = meshwise.init("gloo", timeout=60).comm
    small = {} if stage == 3 else {"bucket_mb": 0.01, "first_bucket_mb": 0.01}  # groups of unequal sizes
    model = shard(_gpt(), comm, stage=stage, **small)
    assert len({g.layout.numel for g in model.groups}) > 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_sharded(model, optimizer, os.path.join(directory, "ckpt"))
    losses = [_step(model, optimizer, comm, s) for s in range(SAVED_AT, TOTAL)]
    other = shard(_gpt(GPTConfig(layers=2, hidden=32, heads=2, seq_len=8, vocab=29)), comm, stage=stage)
    before = other.state_dict()
    error = ""
    try:
        load_sharded(other, None, os.path.join(directory, "ckpt"))
    except ValueError as exc:
        error = str(exc)
    after = other.state_dict()
    untouched = all(torch.equal(before[k], after[k]) for k in before)
    result: dict[str, object] = {"losses": losses, "mismatch": error, "untouched": untouched}
    if comm.world_size == 1:  # the plain, unsharded model reads the same checkpoint
        plain = _gpt()
        load_unsharded(plain, os.path.join(directory, "ckpt"))
        exported = torch.load(os.path.join(directory, "full.pt"), weights_only=True)
        result["plain_equals_export"] = all(
            torch.equal(v, exported[k]) for k, v in plain.state_dict().items()
        )
        x, y = _batch(SAVED_AT)
        with torch.no_grad():
            result["plain_loss"] = language_model_loss(plain(x), y).item()
    meshwise.shutdown()
    return result


@pytest.mark.slow
def test_a_checkpoint_from_4_ranks_continues_on_2_and_on_1_with_the_same_losses(tmp_path):
    directory = str(tmp_path)
    first = spawn(_first_run, 4, (directory,), timeout=110)[0]
    assert "already holds a checkpoint" in first["refused"] and first["unchanged"]
    uninterrupted = first["losses"][SAVED_AT:]
    for ranks, stage in ((2, 2), (1, 1)):
        resumed = spawn(_resume, ranks, (directory, stage), timeout=110)[0]
        assert resumed["losses"] == pytest.approx(uninterrupted, abs=1e-12), (ranks, stage)
        assert "different model" in resumed["mismatch"] and resumed["untouched"], resumed["mismatch"]
    assert resumed["plain_equals_export"]
    # the plain model's loss before continuing is the first continued step's loss (same weights)
    assert resumed["plain_loss"] == pytest.approx(uninterrupted[0], abs=1e-12)
