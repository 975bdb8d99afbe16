"""``meshwise.init()`` under the launchers' environments: layout, device, idempotence, adoption, errors."""

import contextlib
import os
from pathlib import Path

import pytest
import torch.distributed as dist

import meshwise
from conftest import joined
from meshwise.runtime.env import LaunchEnvError
from meshwise.runtime.spawn import spawn

LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _describe(world):
    return {
        "rank": world.rank,
        "local_rank": world.local_rank,
        "world_size": world.world_size,
        "device": str(world.device),
        "backend": world.backend,
        "launcher": world.launcher,
    }


def _single_process():
    for name in LAUNCH_VARS:
        os.environ.pop(name, None)
    first = meshwise.init(timeout=10)
    same = meshwise.init(timeout=10) is first and meshwise.current_world() is first
    meshwise.shutdown()
    return _describe(first), same, dist.is_initialized()


def test_single_process_without_launcher():
    described, same, still_initialised = spawn(_single_process, 1, timeout=60)[0]
    assert described == {
        "rank": 0,
        "local_rank": 0,
        "world_size": 1,
        "device": "cpu",
        "backend": "gloo",
        "launcher": "local",
    }
    assert same and not still_initialised


def _two_ranks():
    world = meshwise.init("gloo", timeout=20)  # MASTER_ADDR is the hostname "localhost": resolved to IPv4
    import torch

    total = torch.tensor([world.rank + 1])
    world.comm.all_reduce(total)
    meshwise.shutdown()
    return _describe(world), total.item()


def test_torchrun_contract_with_hostname_master():
    results = spawn(_two_ranks, 2, env={"MASTER_ADDR": "localhost"}, timeout=60)
    for rank, (described, total) in enumerate(results):
        assert total == 3
        assert described == {
            "rank": rank,
            "local_rank": rank,
            "world_size": 2,
            "device": "cpu",
            "backend": "gloo",
            "launcher": "torchrun",
        }


def _adopt_existing_group():
    import torch

    dist.init_process_group("gloo", init_method="env://")  # an unmodified script's own set-up
    world = meshwise.init("gloo", timeout=20)
    value = torch.tensor([world.rank + 1])
    world.comm.all_reduce(value)
    meshwise.shutdown()  # meshwise did not create the group, so it must leave it alone
    kept = dist.is_initialized()
    dist.destroy_process_group()
    return value.item(), kept


def test_adopts_a_process_group_the_script_created():
    assert spawn(_adopt_existing_group, 2, timeout=60) == [(3, True), (3, True)]


def _gloo_threads() -> int:
    names = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended since the listing
            names.append((task / "comm").read_text().strip())
    return names.count("pt_gloo_runloop")


def _torch_ddp_then_shutdown():
    import torch
    from torch import nn

    with joined("gloo", timeout=20):
        model = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))  # imports torch.distributed.nn lazily
        model(torch.ones(3, 2)).sum().backward()
        del model
        during = _gloo_threads()
    return during, _gloo_threads()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc thread names")
def test_shutdown_releases_the_process_group_after_torch_ddp():
    """Otherwise gloo's threads outlive shutdown() and may abort the finished process at exit."""
    during, after = spawn(_torch_ddp_then_shutdown, 1, timeout=60)[0]
    assert during > 0 and after == 0


def test_incomplete_layout_fails_before_any_process_group(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LaunchEnvError, match="LOCAL_RANK missing"):
        meshwise.init(timeout=5)
    assert not dist.is_initialized()


def test_adopting_a_group_of_another_size_keeps_what_the_launcher_said():
    from meshwise.runtime.env import LaunchEnv
    from meshwise.world import adopt_group_layout

    layout = LaunchEnv(
        "slurm", 5, 1, 8, 2, 2, "node0", 29501, job_id="4242", restart_count=3,
        local_layout_known=False, node_count=4,
    )  # fmt: skip
    assert adopt_group_layout(layout, 5, 8) is layout
    adopted = adopt_group_layout(layout, 1, 2)
    assert (adopted.rank, adopted.world_size) == (1, 2)
    assert (adopted.job_id, adopted.restart_count, adopted.node_count) == ("4242", 3, 4)
    assert not adopted.local_layout_known
    assert (adopted.launcher, adopted.local_rank, adopted.node_rank, adopted.master_port) == (
        "slurm",
        1,
        2,
        29501,
    )
