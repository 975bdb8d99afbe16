"""Launch environment detection: who started this process, and where does it sit in the job.

A pure function of an environment mapping, so every launcher's contract is unit-testable without
processes. Precedence when several launchers' variables are present: torchrun (it runs inside srun and
mpirun allocations and rewrites the layout) > Open MPI > PMI/PMIx > SLURM task > local single process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


class LaunchEnvError(ValueError):
    """The launcher's variables are incomplete, conflicting or out of range."""


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as its launcher described it."""

    launcher: str  # "torchrun" | "openmpi" | "pmi" | "slurm" | "local"
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str | None
    master_port: int | None
    job_id: str | None = None
    restart_count: int = 0

    @property
    def num_nodes(self) -> int:
        return max(1, -(-self.world_size // self.local_world_size))


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise LaunchEnvError(f"{name}={value!r} is not an integer") from None


def _require(env: Mapping[str, str], launcher: str, names: tuple[str, ...]) -> None:
    missing = [n for n in names if n not in env]
    if missing:
        present = [n for n in names if n in env]
        raise LaunchEnvError(
            f"{launcher} variables are incomplete: {', '.join(present)} set but {', '.join(missing)} missing"
        )


def _validate(layout: LaunchEnv) -> LaunchEnv:
    where = f"{layout.launcher} layout"
    if layout.world_size < 1:
        raise LaunchEnvError(f"{where}: world size {layout.world_size} must be at least 1")
    if not 0 <= layout.rank < layout.world_size:
        raise LaunchEnvError(f"{where}: rank {layout.rank} is outside 0..{layout.world_size - 1}")
    if not 1 <= layout.local_world_size <= layout.world_size:
        raise LaunchEnvError(
            f"{where}: local world size {layout.local_world_size} must be within 1..{layout.world_size}"
        )
    if not 0 <= layout.local_rank < layout.local_world_size:
        raise LaunchEnvError(
            f"{where}: local rank {layout.local_rank} is outside 0..{layout.local_world_size - 1}"
        )
    if layout.master_port is not None and not 0 < layout.master_port < 65536:
        raise LaunchEnvError(f"{where}: master port {layout.master_port} is outside 1..65535")
    return layout


def _torchrun(env: Mapping[str, str]) -> LaunchEnv:
    _require(env, "torchrun", ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    world = _int(env, "WORLD_SIZE")
    if world > 1:
        _require(env, "torchrun", ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
    return LaunchEnv(
        launcher="torchrun",
        rank=_int(env, "RANK"),
        local_rank=_int(env, "LOCAL_RANK"),
        world_size=world,
        local_world_size=local_world,
        node_rank=_int(env, "GROUP_RANK") if "GROUP_RANK" in env else _int(env, "RANK") // local_world,
        master_addr=env.get("MASTER_ADDR"),
        master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else None,
        job_id=env.get("TORCHELASTIC_RUN_ID"),
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT") if "TORCHELASTIC_RESTART_COUNT" in env else 0,
    )


def _local() -> LaunchEnv:
    return LaunchEnv("local", 0, 0, 1, 1, 0, None, None)


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """The layout described by ``environ`` (default: this process's environment)."""
    env = os.environ if environ is None else environ
    if any(name in env for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return _validate(_torchrun(env))
    return _local()
