"""DataParallel against one process on the full batch (the CS336 / PyTorch DDP test), on gloo and shm.

Each rank trains a DataParallel replica on its shard while also training, itself, a plain replica on the
whole batch from the same initial weights; after every step the two must agree. One spawn per world size
runs every combination (backend × optimizer × accumulation) and returns the worst difference of each, so a
failure names the combination.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
from torch import nn

from conftest import joined
from meshwise.comm.shm import ShmCommunicator
from meshwise.parallel import DataParallel
from meshwise.parallel.data_parallel.buckets import MIB
from meshwise.runtime.spawn import spawn

STEPS = 5
PER_RANK = 8  # samples per rank per step (two micro-batches of 4 with accumulation)
TINY_BUCKETS = {"bucket_mb": 1100 / MIB, "first_bucket_mb": 300 / MIB}  # 3 buckets for the model below


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.GELU(),
        nn.Linear(16, 16),
        nn.GELU(),
        nn.Linear(16, 16),
        nn.GELU(),
        nn.Linear(16, 4),
    )


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(PER_RANK * world_size, 8, generator=generator)
    return x, torch.randn(PER_RANK * world_size, 4, generator=generator)


def _max_difference(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _train_pair(comm, optimizer: str, micro_batches: int, compress: str | None = None) -> float:
    """Worst parameter difference between DP-on-shards and one process on the full batch, over STEPS."""
    rank, world_size = comm.rank, comm.world_size
    reference = _model()
    replica = copy.deepcopy(reference)
    if rank != 0:  # a different start everywhere else: wrapping must broadcast rank 0's weights
        with torch.no_grad():
            for p in replica.parameters():
                p.add_(1.0)
    model = DataParallel(replica, comm, compress=compress, **TINY_BUCKETS)
    assert len(model.buckets) >= 3
    ref_opt, dp_opt = _optimizer(optimizer, reference), _optimizer(optimizer, replica)
    worst = 0.0
    for step in range(STEPS):
        x, y = _batch(step, world_size)
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        dp_opt.zero_grad()
        shard_x, shard_y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        pieces = list(zip(shard_x.chunk(micro_batches), shard_y.chunk(micro_batches), strict=True))
        for i, (mx, my) in enumerate(pieces):
            with model.no_sync() if i < len(pieces) - 1 else nullcontext():
                (nn.functional.mse_loss(model(mx), my) / micro_batches).backward()
        dp_opt.step()
        worst = max(worst, _max_difference(reference, replica))
    return worst


def _parity() -> dict[str, float]:
    with joined("gloo", timeout=60) as world:
        comms = {"gloo": world.comm, "shm": ShmCommunicator.from_process_group(None, timeout=60)}
        results = {}
        for backend, comm in comms.items():
            for optimizer in ("sgd", "adamw"):
                for micro in (1, 2):
                    results[f"{backend}/{optimizer}/micro{micro}"] = _train_pair(comm, optimizer, micro)
            results[f"{backend}/sgd/bf16"] = _train_pair(comm, "sgd", 1, compress="bf16")
        comms["shm"].close()
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_parameters_match_one_process_on_the_full_batch_after_every_step(world_size):
    per_rank = spawn(_parity, world_size, timeout=100)
    for rank, results in enumerate(per_rank):
        exact = {k: v for k, v in results.items() if not k.endswith("bf16")}
        assert all(v <= 1e-6 for v in exact.values()), f"rank {rank}: {exact}"
        for key in ("gloo/sgd/bf16", "shm/sgd/bf16"):  # compression rounds, but only by bf16's precision
            assert 0 < results[key] < 5e-3, f"rank {rank} {key}: {results[key]}"


# ---------------------------------------------------------------------------------------------- behaviours
class RecordingComm:
    """A Communicator stand-in that notes, in a shared event list, when each all_reduce is issued."""

    def __init__(self, comm, events: list[str]) -> None:
        self._comm, self._events = comm, events

    def __getattr__(self, name: str):
        return getattr(self._comm, name)

    def all_reduce(self, *args, **kwargs):
        self._events.append("all_reduce")
        return self._comm.all_reduce(*args, **kwargs)


def _overlap(comm) -> dict[str, object]:
    events: list[str] = []
    model = _model()
    model[0].register_full_backward_pre_hook(lambda *_: events.append("first layer backward"))
    dp = DataParallel(model, RecordingComm(comm, events), **TINY_BUCKETS)
    x, y = _batch(0, comm.world_size)
    nn.functional.mse_loss(dp(x), y).backward()
    events.append("backward returned")
    return {"events": events, "buckets": len(dp.buckets)}


def _no_sync_traffic(comm) -> tuple[int, int, int]:
    """All-reduces issued by a backward under no_sync, then by the synchronised one after it; buckets."""
    events: list[str] = []
    dp = DataParallel(_model(), RecordingComm(comm, events), **TINY_BUCKETS)
    x, y = _batch(0, comm.world_size)
    with dp.no_sync():
        nn.functional.mse_loss(dp(x), y).backward()
    inside = events.count("all_reduce")
    nn.functional.mse_loss(dp(x), y).backward()
    return inside, events.count("all_reduce") - inside, len(dp.buckets)


class Branchy(nn.Module):
    """A trunk always used, a branch used when asked, and a layer never used."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.trunk, self.branch, self.never = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        y = self.trunk(x)
        return self.branch(y) if use_branch else y


def _branchy_step(comm, use_branch: bool, find_unused: bool) -> tuple[str, DataParallel]:
    dp = DataParallel(Branchy(), comm, find_unused_parameters=find_unused)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(comm.rank))
    try:
        dp(x, use_branch).square().mean().backward()
    except Exception as exc:  # the test inspects which ranks raised what
        return f"{type(exc).__name__}: {exc}", dp
    return "", dp


def _in_sync(comm) -> bool:
    """A collective after an error still pairs up correctly: nobody was left behind in the step."""
    probe = torch.tensor([float(comm.rank + 1)])
    comm.all_reduce(probe)
    return probe.item() == comm.world_size * (comm.world_size + 1) / 2


def _expected_grads(comm, use_branch: bool) -> dict[str, torch.Tensor]:
    """The average over ranks of plain local gradients, a missing gradient counting as zeros."""
    plain = Branchy()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(comm.rank))
    plain(x, use_branch).square().mean().backward()
    grads = {}
    for name, p in plain.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        comm.all_reduce(grad, "avg")
        grads[name] = grad
    return grads


class FailOnce(torch.autograd.Function):
    """Identity whose first backward raises, as a model bug would, half-way through backward."""

    armed = True

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if FailOnce.armed:
            FailOnce.armed = False
            raise RuntimeError("injected failure")
        return grad


class Injected(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FailOnce.apply(x)


def _after_a_failed_backward(comm) -> dict[str, object]:
    model = _model()
    model.insert(1, Injected())  # after the first layer: later buckets are launched before it fails
    plain = copy.deepcopy(model)
    dp = DataParallel(model, comm, **TINY_BUCKETS)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(comm.rank))
    try:
        dp(x).square().mean().backward()
        failed = ""
    except RuntimeError as exc:
        failed = str(exc)
    model.zero_grad()
    dp(x).square().mean().backward()
    plain(x).square().mean().backward()
    expected = [p.grad.clone() for p in plain.parameters()]
    for grad in expected:
        comm.all_reduce(grad, "avg")
    averaged = all(
        torch.allclose(p.grad, g, atol=1e-7) for p, g in zip(model.parameters(), expected, strict=True)
    )
    return {"failed": failed, "next step averaged": averaged}


def _behaviours() -> dict[str, object]:
    with joined("gloo", timeout=60) as world:
        comm, rank = world.comm, world.rank
        shm = ShmCommunicator.from_process_group(None, timeout=60)
        out: dict[str, object] = {"overlap/gloo": _overlap(comm), "overlap/shm": _overlap(shm)}
        shm.close()
        out["after a failed backward"] = _after_a_failed_backward(comm)
        out["no_sync traffic"] = _no_sync_traffic(comm)

        error, _ = _branchy_step(comm, use_branch=False, find_unused=False)
        out["unused everywhere"] = (error, _in_sync(comm))
        error, _ = _branchy_step(comm, use_branch=rank == 0, find_unused=False)
        out["unused on rank 1"] = (error, _in_sync(comm))

        expected = _expected_grads(comm, use_branch=rank == 0)
        error, dp = _branchy_step(comm, use_branch=rank == 0, find_unused=True)
        grads = dict(dp.module.named_parameters())
        out["find_unused"] = {
            "error": error,
            "never has no grad": grads["never.weight"].grad is None and grads["never.bias"].grad is None,
            "others averaged": all(
                torch.allclose(p.grad, expected[n], atol=1e-7)
                for n, p in grads.items()
                if not n.startswith("never")
            ),
        }

        plain = Branchy()
        wrapped = DataParallel(Branchy(), comm)
        state = wrapped.state_dict()
        out["state keys"] = (list(state), list(plain.state_dict()))
        plain.load_state_dict(state)  # strict: raises on any prefix mismatch
        wrapped.load_state_dict(Branchy().state_dict())
        out["state loads"] = True
    return out


@pytest.fixture(scope="module")
def behaviours() -> list[dict[str, object]]:
    return spawn(_behaviours, 2, timeout=100)


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_buckets_are_reduced_mid_backward_only_where_communication_overlaps_compute(behaviours, backend):
    for result in behaviours:
        overlap = result[f"overlap/{backend}"]
        events = overlap["events"]
        assert overlap["buckets"] >= 3
        assert events.count("all_reduce") == overlap["buckets"]  # one all-reduce per bucket, all issued...
        first_reduce, first_layer = events.index("all_reduce"), events.index("first layer backward")
        if backend == "gloo":  # ...the first mid-backward, while gloo's engine moves it in the background
            assert first_reduce < first_layer
        else:  # ...after backward on shm, whose collectives complete on the calling thread
            assert first_reduce > first_layer
        assert events[-1] == "backward returned"


def test_no_sync_communicates_nothing_until_the_next_synchronised_backward(behaviours):
    for result in behaviours:
        inside, after, buckets = result["no_sync traffic"]
        assert (inside, after) == (0, buckets)  # then one all-reduce per bucket


def test_unused_parameters_raise_an_error_naming_them_without_a_hang(behaviours):
    for result in behaviours:
        error, in_sync = result["unused everywhere"]
        assert error.startswith("UnusedParametersError")
        assert "branch.weight" in error and "never.bias" in error and "trunk" not in error
        assert "find_unused_parameters=True" in error
        assert in_sync


def test_a_parameter_unused_on_one_rank_is_named_only_there_and_peers_finish_the_step(behaviours):
    (error0, in_sync0), (error1, in_sync1) = (result["unused on rank 1"] for result in behaviours)
    assert "never.weight" in error0 and "branch" not in error0  # rank 0 used the branch
    assert "never.weight" in error1 and "branch.weight" in error1
    assert in_sync0 and in_sync1


def test_find_unused_parameters_averages_with_zeros_and_leaves_globally_unused_grads_none(behaviours):
    for result in behaviours:
        assert result["find_unused"] == {"error": "", "never has no grad": True, "others averaged": True}


def test_a_backward_that_fails_half_way_does_not_leave_the_next_step_unsynchronised(behaviours):
    for result in behaviours:
        assert result["after a failed backward"] == {"failed": "injected failure", "next step averaged": True}


def test_state_dict_has_no_wrapper_prefix_and_round_trips(behaviours):
    for result in behaviours:
        keys, plain_keys = result["state keys"]
        assert keys == plain_keys and not any(k.startswith("module.") for k in keys)
        assert result["state loads"] is True


def _world_of_one() -> dict[str, bool]:
    with joined("gloo", timeout=60):
        plain, replica = _model(), _model()
        dp = DataParallel(replica)  # the current world's communicator
        x, y = _batch(0, 1)
        nn.functional.mse_loss(plain(x), y).backward()
        nn.functional.mse_loss(dp(x), y).backward()
    return {
        "nothing to average": not dp._reducers,
        "same gradients": all(
            torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), replica.parameters(), strict=True)
        ),
    }


def test_a_world_of_one_only_forwards():
    assert spawn(_world_of_one, 1, timeout=60) == [{"nothing to average": True, "same gradients": True}]
