"""Debug mode: check every collective's fingerprint across ranks before its data moves.

Each rank posts the fingerprint of its collective number ``seq`` to the job's key-value store (the one
torch.distributed rendezvoused through, so this works under every backend, and a transport that is about
to hang is not the one that reports it), then reads every other rank's. When they cannot meet, every
rank raises the same :class:`CollectiveMismatchError` naming both calls, their call sites and the ranks —
within the store's round-trip time, instead of a transport timeout minutes later.

A rank that skips its last collective reaches ``close`` (``meshwise.shutdown()``) instead, which is
checked like a collective, so the skip is reported too. A rank that never arrives at all is reported
after the communicator's timeout, with the last collective it did post.

Cost: four store round trips per collective (post, wait, read, drop the previous key), measured in
``docs/diagnose.md``; nothing per point-to-point message.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence

import torch.distributed as dist

from meshwise.comm.api import CollectiveMismatchError, CommTimeoutError
from meshwise.comm.fingerprint import Fingerprint, find_mismatch, rank_list


def default_store() -> dist.Store:
    """The store torch.distributed's default group rendezvoused through (private API, one place)."""
    return dist.distributed_c10d._get_default_store()


class DebugChecker:
    """Cross-rank fingerprint check for one group: ``rank`` of ``world_size``, keys under ``prefix``."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, world_size: int, timeout: float) -> None:
        self.store, self.prefix = store, prefix
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.previous: list[Fingerprint] | None = None
        self.broken = False  # after a mismatch or timeout, peers are no longer in step: check nothing

    def _key(self, seq: int, rank: int) -> str:
        return f"{self.prefix}/{seq}/{rank}"

    def child(self, name: str, rank: int, world_size: int) -> DebugChecker:
        """The checker of a subgroup (``name`` is the same on its members, unique in this group)."""
        return DebugChecker(self.store, f"{self.prefix}/{name}", rank, world_size, self.timeout)

    def check(self, fp: Fingerprint) -> None:
        """Return once every rank posted a matching fingerprint for ``fp.seq``; raise otherwise."""
        if self.broken:
            return
        if self.world_size == 1:
            return
        self.store.set(self._key(fp.seq, self.rank), json.dumps(fp.to_json()))
        others = [self._key(fp.seq, r) for r in range(self.world_size)]
        try:
            self.store.wait(others, datetime.timedelta(seconds=self.timeout))
        except Exception as exc:  # the store raises a plain RuntimeError/DistStoreError on timeout
            self.broken = True
            raise CommTimeoutError(self._absent(fp, others), rank=self.rank, op=fp.op) from exc
        prints = [Fingerprint.from_json(json.loads(v)) for v in self.store.multi_get(others)]
        if fp.seq > 1:
            self.store.delete_key(self._key(fp.seq - 1, self.rank))  # every peer has read it by now
        problem = find_mismatch(prints)
        if problem is not None:
            self.broken = True
            raise CollectiveMismatchError(problem, rank=self.rank, op=fp.op)
        self.previous = prints

    def _absent(self, fp: Fingerprint, keys: Sequence[str]) -> str:
        missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
        where = ", ".join(
            f"rank {r} last posted "
            + (
                f"{self.previous[r].describe()} at {self.previous[r].site} (#{fp.seq - 1})"
                if self.previous is not None
                else "nothing"
            )
            for r in missing
        )
        return (
            f"debug mode: {rank_list(missing)} did not reach collective #{fp.seq} "
            f"({fp.describe()} at {fp.site}) within {self.timeout:g} s; {where}"
        )
