"""The names of the data-moving collectives, torch-free: the algorithm registry and the planner price
collectives by these names without importing the Communicator (and torch) that runs them.

:mod:`meshwise.comm.api` exports :class:`Collective` too, as part of the Communicator's vocabulary.
"""

from __future__ import annotations

import enum


class Collective(str, enum.Enum):
    """The data-moving collectives of a Communicator (barrier moves none), in one canonical order.

    The algorithm registry, the cost model, the consistency check, the shm signatures and the benchmark
    all read this list, so a new collective is added here once. Members compare equal to their names
    (``Collective.ALL_REDUCE == "all_reduce"``); :meth:`parse` turns a user's name into a member.
    """

    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    SCATTER = "scatter"
    GATHER = "gather"
    ALL_TO_ALL = "all_to_all"

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:  # as its name hashes, so a table keyed by members answers plain names too
        return str.__hash__(self)

    @classmethod
    def parse(cls, name: str) -> Collective:
        """The member called ``name``, or a ValueError listing the names there are."""
        try:
            return cls(name)
        except ValueError:
            names = ", ".join(c.value for c in cls)
            raise ValueError(f"unknown collective {name!r}; choose one of {names}") from None
