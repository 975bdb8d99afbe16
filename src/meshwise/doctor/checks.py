"""The list of checks and their common result type.

Each check is a small function of explicit facts (sizes, names, environment) with the live values as
defaults, so the tests can hand it a 64 MiB ``/dev/shm`` or a misspelt interface without a container.
A check never raises: a probe that fails is itself a finding.
"""

from __future__ import annotations

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


def run_checks(ranks: int, env: Mapping[str, str] | None = None) -> list[Check]:
    """Every check for a job of ``ranks`` local ranks, under ``env`` (default: this process's)."""
    import os

    from meshwise.doctor import network, software, system

    env = dict(os.environ if env is None else env)
    probes: list[Callable[[], list[Check]]] = [
        lambda: system.check_shm(ranks),
        lambda: system.check_open_files(ranks),
        lambda: system.check_locked_memory(),
        lambda: system.check_cores(ranks),
        lambda: network.check_loopback(),
        lambda: network.check_interfaces(env),
        lambda: network.check_master_addr(env),
        lambda: software.check_devices(ranks, env),
        lambda: software.check_nccl_env(env),
        lambda: software.check_mpi(ranks),
        lambda: software.check_versions(),
    ]
    found: list[Check] = []
    for probe in probes:
        try:
            found.extend(probe())
        except Exception as exc:  # a broken probe is a finding, never a crash of the doctor
            found.append(
                Check(getattr(probe, "__name__", "check"), "warn", f"the check itself failed: {exc}")
            )
    return found
