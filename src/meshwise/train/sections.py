"""The settings sections both ``meshwise train`` commands share, and the one mapping from flat flags to
sections.

A training config is plain data: frozen sections of flag values, no file or environment reads (those
happen once, in each command's resolve step). Every field is named after its flag's argparse ``dest``, so
the command line, the tests and ``from_flags`` all spell a setting one way, and every parser default is
read from these fields (:meth:`FlagSections.flag_defaults`), never written twice.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields, is_dataclass, replace
from typing import Any, TypeVar, get_type_hints

from meshwise.runtime.timeouts import wait_timeout

#: ``--zero`` stages: 0 is plain data parallelism, 1/2/3 shard optimizer state / + gradients / + parameters
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class MeshSection:
    """Where the ranks run: how many, over which communicator and device, with which ZeRO stage."""

    nproc: int | None = None  # local ranks to start; None: 1, or the ranks a launcher started
    backend: str = "auto"
    device: str | None = None  # None: cuda if present
    zero: int = 0  # ZeRO stage over the data-parallel ranks; 0: off
    timeout: float | None = None  # a deadline for the whole job (None: none); waits time out anyway

    @property
    def comm_timeout(self) -> float:
        """Each wait's bound; ``timeout`` bounds the whole job."""
        return wait_timeout(self.timeout)

    def check(self) -> None:
        at_least_one({"-np": self.nproc})
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError(f"--timeout must be positive seconds, got {self.timeout}")
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"--zero must be 0, 1, 2 or 3 (the ZeRO stage), got {self.zero}")


@dataclass(frozen=True)
class OutputSection:
    """What the run leaves behind: its checkpoint directory and the metrics file."""

    checkpoint: str | None = None  # DCP checkpoint directory
    resume: bool = False  # continue the run checkpointed in ``checkpoint``
    json: str | None = None  # the run's metrics as one JSON file, written by the command

    def check(self) -> None:
        if self.resume and self.checkpoint is None:
            raise ValueError("--resume needs --checkpoint DIR: the directory of the run to continue")


@dataclass(frozen=True)
class ProfileSection:
    """What the run measures about itself."""

    profile: bool = False  # time each step's phases, print the breakdown and a verdict
    trace: str | None = None  # Chrome/Perfetto trace of the profiled steps (implies profile)

    @property
    def profiling(self) -> bool:
        return self.profile or self.trace is not None


def at_least_one(flags: dict[str, int | None]) -> None:
    """Each count given (not None) in ``flags`` (by flag) is at least 1."""
    for flag, value in flags.items():
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")


def check_seed(seed: int) -> None:
    if not 0 <= seed < 2**63:
        raise ValueError(f"--seed must be in 0 .. 2**63-1, got {seed}")


Config = TypeVar("Config", bound="FlagSections")


def sections_of(config_type: type) -> dict[str, type]:
    """The config's section fields and their classes (its other fields are its own settings)."""
    hints = get_type_hints(config_type)
    return {f.name: hints[f.name] for f in fields(config_type) if is_dataclass(hints[f.name])}


class FlagSections:
    """A config made of sections and its own fields, spelled by its command's flat flags: the one mapping
    between the two, used by the CLI and the tests."""

    @classmethod
    def flag_defaults(cls) -> dict[str, Any]:
        """Every flag's default, by argparse dest: what the parsers use, read from the section fields."""
        return {
            f.name: f.default
            for section in sections_of(cls).values()
            for f in fields(section)
            if f.default is not MISSING
        }

    @classmethod
    def from_flags(cls: type[Config], *own: Any, **flags: Any) -> Config:
        """The config of flat flag values by argparse dest (``TrainConfig.from_flags("mlp", zero=1)``;
        ``own``: its own leading fields): each goes to the section that has a field of its name, the rest
        to the config's own fields; a name no section has is a TypeError."""
        sections = {name: section(**_take(section, flags)) for name, section in sections_of(cls).items()}
        return cls(*own, **flags, **sections)

    def with_flags(self: Config, **changes: Any) -> Config:
        """This config with some flags changed (``config.with_flags(resume=True)``), mapped as
        :meth:`from_flags` maps them."""
        sections = {
            name: replace(getattr(self, name), **_take(section, changes))
            for name, section in sections_of(type(self)).items()
        }
        return replace(self, **changes, **sections)  # type: ignore[type-var]


def _take(section: type, flags: dict[str, Any]) -> dict[str, Any]:
    """The flags named after ``section``'s fields, taken out of ``flags`` (what is left: the config's
    own fields, or names nothing has)."""
    return {f.name: flags.pop(f.name) for f in fields(section) if f.name in flags}
