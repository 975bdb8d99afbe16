"""The list of checks and their common result type.

Each check is a small function of explicit facts (sizes, names, environment) with the live values as
defaults, so the tests can hand it a 64 MiB ``/dev/shm`` or a misspelt interface without a container.
A check never raises: a probe that fails is itself a finding.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

#: severities, mildest first; ``fail`` makes ``meshwise doctor`` exit 1.
STATUSES = ("pass", "warn", "fail")


@dataclass(frozen=True)
class Check:
    """One finding: ``status`` is pass, warn or fail; ``fix`` says what to change when it is not pass."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def run_checks(
    ranks: int,
    env: Mapping[str, str] | None = None,
    master: tuple[str, int] | None = None,
) -> list[Check]:
    """Every check for a job of ``ranks`` local ranks, under ``env`` (default: this process's); with
    ``master`` (address, port), also the multi-node launch's pre-flight from this node."""
    from meshwise.doctor import network, software, system  # they import Check from here

    env = dict(os.environ if env is None else env)
    probes: dict[str, Callable[[], list[Check]]] = {
        "/dev/shm": lambda: system.check_shm(ranks),
        "open files": lambda: system.check_open_files(ranks),
        "locked memory": system.check_locked_memory,
        "cores": lambda: system.check_cores(ranks),
        "loopback": network.check_loopback,
        "interfaces": lambda: network.check_interfaces(env),
        "MASTER_ADDR": lambda: network.check_master_addr(env),
        "route to master": lambda: network.check_master_route(*master, env) if master else [],
        "devices": lambda: software.check_devices(ranks, env),
        "NCCL environment": lambda: software.check_nccl_env(env),
        "MPI": lambda: software.check_mpi(ranks),
        "versions": software.check_versions,
    }
    found: list[Check] = []
    for name, probe in probes.items():
        try:
            found.extend(probe())
        except Exception as exc:  # a broken probe is a finding, never a crash of the doctor
            found.append(Check(name, "warn", f"the check itself failed: {exc}", "report this as a bug"))
    return found
