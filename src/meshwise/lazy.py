"""Package names whose module is imported on first use (PEP 562), so torch-free submodules stay torch-free.

Importing any submodule runs every package ``__init__`` above it. ``meshwise plan`` is arithmetic only, yet
``meshwise.plan`` needs ``meshwise.comm.cost`` and ``meshwise.models``: had those packages imported their
torch-backed members eagerly, every plan would spend ~2 s importing torch. Such a package names those
members here instead; the first read of one imports its module, and the value is then kept on the package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_names(
    package: str, sources: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: each name in ``sources[module]`` reads as the
    attribute of that name of ``module`` (absolute), imported when the name is first read."""
    home = {name: module for module, names in sources.items() for name in names}

    def __getattr__(name: str) -> object:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | home.keys())

    return __getattr__, __dir__
