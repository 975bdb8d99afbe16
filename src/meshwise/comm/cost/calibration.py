"""A machine's link parameters: the dataclasses, the built-in defaults and the file format.

Three links are calibrated: ``intra`` (our algorithms between ranks of one node), ``inter`` (between
nodes) and ``native`` (the backend's own collectives, so ``auto`` only replaces them where an algorithm of
ours is predicted to be faster). ``intra`` and ``native`` may also be calibrated per world size
(:meth:`Calibration.for_world`): on a machine whose ranks share cores, α grows with the number of ranks,
so one set of parameters cannot describe both 2 and 4 ranks. A job over several nodes also calibrates
:class:`Levels`, the links of the two-level communicator (one transport inside a node, another between).

Nothing reads a file behind the caller's back: a calibration is either :meth:`Calibration.builtin`
(the documented default wherever one is optional) or :meth:`Calibration.load` of a path the caller
names, and :attr:`Calibration.source` says which, so a run can report what its choices were priced with.
:data:`DEFAULT_FILE` is only where ``meshwise bench --calibrate`` writes when given no path.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from meshwise.comm.cost.formulas import LinkParams

#: ``source`` of the built-in calibration
BUILTIN = "built-in"

#: where ``meshwise bench --calibrate`` writes when given no ``--calibration-file``; never read unless named
DEFAULT_FILE = Path("~/.cache/meshwise/calibration.json")

# Built-in defaults, from `benchmarks/bench_algorithms.py -np 2,4` on the 2-core development box (gloo over
# loopback, heavily shared): each point-to-point step of our plans cost 1–4 ms there (Python executor and
# gloo's per-message handshake) against ~0.2 ms per step inside gloo's own collectives, and our large
# messages reached ~0.5–0.8x of gloo's ring bandwidth. With these numbers ``auto`` keeps the native
# collective on such a machine; ``meshwise bench --calibrate`` measures the user's own.
_DEFAULT_INTRA = LinkParams(alpha=1.5e-3, beta=1.0e-9, gamma=5.0e-10)
_DEFAULT_INTER = LinkParams(alpha=1.5e-3, beta=1.0e-9, gamma=5.0e-10)
_DEFAULT_NATIVE = LinkParams(alpha=2.0e-4, beta=4.0e-10, gamma=4.0e-10)


@dataclass(frozen=True)
class Levels:
    """The links of the two-level communicator (``backend="auto"`` across nodes: shared memory inside a
    node, gloo or NCCL between nodes), each measured on that transport's own collectives:

    * ``intra`` — among the ranks of one node, on the intra-node transport;
    * ``inter`` — among the ranks at one local position on every node, *while every local position
      runs at once* (the pattern of the hierarchical collectives, so a network the L ranks of a node
      share shows up as an L× larger β);
    * ``flat``  — the inter-node transport's collectives over the whole job (what runs when the model
      says the hierarchy does not pay);
    * ``switch`` — seconds per hand-over between the levels inside one hierarchical call beyond the two
      levels' calls on their own: the ranks leave one level's call at different moments (a gloo call
      ends when its thread wakes the rank) and the next level's call waits for the last of them, while
      spinning shared-memory waiters take cores from the others. Measured as the hierarchical
      all_reduce's time at small sizes minus its levels' prices, per hand-over (0 when not measured).
    """

    intra: LinkParams
    inter: LinkParams
    flat: LinkParams
    switch: float = 0.0


# Built-in levels: shared memory at ~5 GB/s inside a node, a 10 Gbit/s network between nodes (shared by
# two ranks per node in the hierarchical pattern). Only an order of magnitude: `meshwise bench
# --calibrate` on two or more nodes measures the real ones.
_DEFAULT_LEVELS = Levels(
    intra=LinkParams(alpha=2.0e-5, beta=2.0e-10, gamma=2.0e-10),
    inter=LinkParams(alpha=1.0e-4, beta=1.6e-9, gamma=4.0e-10),
    flat=LinkParams(alpha=1.0e-4, beta=8.0e-10, gamma=4.0e-10),
)


@dataclass(frozen=True)
class CostSample:
    """One measurement: ``seconds`` for ``collective`` with ``algo`` on ``nbytes`` over ``world_size``."""

    collective: str
    algo: str
    nbytes: int
    world_size: int
    seconds: float


@dataclass(frozen=True)
class WorldLinks:
    """The links measured in a job of one world size: α in particular depends on how many ranks share the
    cores, so these override the top-level values for that size. ``inter`` stays global."""

    intra: LinkParams
    native: LinkParams


@dataclass(frozen=True)
class Calibration:
    """Link parameters of one machine: within a node, between nodes, and the backend's own collectives.

    The top-level links are the default (the latest fit, or a joint fit over world sizes);
    ``by_world_size`` holds (world size, links) pairs measured at that size, sorted and unique. It is a
    tuple rather than a dict so that a calibration stays hashable (``auto`` caches its choices by it).
    ``source`` (the file it was read from, or :data:`BUILTIN`) takes no part in equality.
    """

    intra: LinkParams
    inter: LinkParams
    native: LinkParams = _DEFAULT_NATIVE
    by_world_size: tuple[tuple[int, WorldLinks], ...] = ()
    source: str = field(default=BUILTIN, compare=False)
    #: the two-level communicator's links (None: never calibrated across nodes; the built-in ones apply)
    levels: Levels | None = None

    def __post_init__(self) -> None:
        entries = dict(self.by_world_size)
        if len(entries) != len(self.by_world_size) or any(p < 1 for p in entries):
            raise ValueError(f"by_world_size needs unique world sizes >= 1, got {sorted(entries)}")
        object.__setattr__(self, "by_world_size", tuple(sorted(entries.items())))

    @classmethod
    def builtin(cls) -> Calibration:
        """The documented default: the development box's values (``auto`` then keeps native collectives)."""
        return cls(_DEFAULT_INTRA, _DEFAULT_INTER, _DEFAULT_NATIVE)

    def level_switch(self) -> float:
        """The two-level communicator's hand-over time (:attr:`Levels.switch`; 0 until measured)."""
        return self.levels.switch if self.levels is not None else _DEFAULT_LEVELS.switch

    def two_level(self) -> Calibration:
        """What the two-level communicator prices with, in the shape ``choose_algorithm`` reads: its
        intra- and inter-node levels as ``intra`` / ``inter``, its flat collectives as ``native``."""
        levels = self.levels if self.levels is not None else _DEFAULT_LEVELS
        return Calibration(levels.intra, levels.inter, levels.flat, source=self.source)

    def with_levels(self, levels: Levels) -> Calibration:
        """This calibration with the two-level links replaced."""
        return replace(self, levels=levels)

    def with_world(self, world_size: int, links: WorldLinks) -> Calibration:
        """This calibration with the entry for ``world_size`` set to ``links`` (the others kept), so that
        calibrating one world size after another accumulates them."""
        entries = {**dict(self.by_world_size), world_size: links}
        return replace(self, by_world_size=tuple(entries.items()))

    def for_world(self, world_size: int) -> Calibration:
        """The links to price a job of ``world_size`` ranks with: the entry measured at that size, else the
        nearest measured size (by |log2 ratio|, ties to the larger, which errs towards more contention),
        else the top-level values. The result has no per-world entries of its own."""
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if not self.by_world_size:
            return replace(self, by_world_size=())
        _, links = min(
            self.by_world_size, key=lambda entry: (abs(math.log2(entry[0] / world_size)), -entry[0])
        )
        return replace(self, intra=links.intra, native=links.native, by_world_size=())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Calibration:
        """Read the calibration file ``path``, which must exist (ValueError naming the fix if malformed)."""
        file = Path(path).expanduser()
        if not file.exists():
            raise FileNotFoundError(
                f"calibration file {file} does not exist; run `meshwise bench --calibrate`"
            )
        try:
            return _from_json(json.loads(file.read_text()), source_of(file))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"calibration file {file} is malformed ({exc}); it needs 'intra' (and optionally 'inter', "
                "'native') objects with alpha, beta, gamma, and optionally 'by_world_size' mapping world "
                "sizes to 'intra' and 'native' objects — re-run `meshwise bench --calibrate` or delete it"
            ) from exc

    @classmethod
    def from_option(cls, path: str | os.PathLike[str] | None) -> Calibration:
        """What a ``--calibration-file`` option means: the named file, or :meth:`builtin` when unset."""
        return cls.builtin() if path is None else cls.load(path)

    def save(self, path: str | os.PathLike[str]) -> Path:
        file = Path(path).expanduser()
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps(_to_json(self), indent=2) + "\n")
        return file


def source_of(path: str | os.PathLike[str] | None) -> str:
    """The :attr:`Calibration.source` :meth:`Calibration.from_option` gives ``path``, without reading it."""
    return BUILTIN if path is None else str(Path(path).expanduser())


def _to_json(calibration: Calibration) -> dict[str, object]:
    """The file's layout: top-level links, plus ``by_world_size`` keyed by the world size as a string
    (JSON keys are strings) only when there are entries, so files without them keep their old form."""
    raw: dict[str, object] = {
        name: _link_json(getattr(calibration, name)) for name in ("intra", "inter", "native")
    }
    if calibration.by_world_size:
        raw["by_world_size"] = {
            str(p): {"intra": _link_json(links.intra), "native": _link_json(links.native)}
            for p, links in calibration.by_world_size
        }
    if calibration.levels is not None:
        levels = calibration.levels
        entry: dict[str, object] = {name: _link_json(getattr(levels, name)) for name in _LEVEL_LINKS}
        if levels.switch:
            entry["switch"] = levels.switch
        raw["levels"] = entry
    return raw


#: the links of :class:`Levels`, as the file names them
_LEVEL_LINKS = ("intra", "inter", "flat")


def _link_json(link: LinkParams) -> dict[str, float]:
    """A link's entry; ``burst`` only where the link has one, so files of plain links keep their form."""
    raw = asdict(link)
    if not link.burst:
        del raw["burst"]
    return raw


def _from_json(raw: object, source: str) -> Calibration:
    """Inverse of :func:`_to_json`; KeyError, TypeError or ValueError on anything else (load explains)."""
    if not isinstance(raw, Mapping):
        raise TypeError(f"expected a JSON object, got {type(raw).__name__}")
    intra = _link(raw["intra"])
    inter = _link(raw["inter"]) if "inter" in raw else intra
    native = _link(raw["native"]) if "native" in raw else _DEFAULT_NATIVE
    entries = raw.get("by_world_size", {})
    if not isinstance(entries, Mapping):
        raise TypeError(f"'by_world_size' must be an object, got {type(entries).__name__}")
    by_world = []
    for key, value in entries.items():
        if not isinstance(value, Mapping):
            raise TypeError(f"by_world_size[{key!r}] must be an object, got {type(value).__name__}")
        by_world.append((int(key), WorldLinks(_link(value["intra"]), _link(value["native"]))))
    levels = None
    if "levels" in raw:
        entry = raw["levels"]
        if not isinstance(entry, Mapping):
            raise TypeError(f"'levels' must be an object, got {type(entry).__name__}")
        switch = float(entry.get("switch", 0.0))
        levels = Levels(*(_link(entry[name]) for name in _LEVEL_LINKS), switch=switch)
    return Calibration(intra, inter, native, tuple(by_world), source, levels)


def _link(raw: object) -> LinkParams:
    if not isinstance(raw, Mapping):
        raise TypeError(f"a link must be an object with alpha, beta, gamma, got {raw!r}")
    return LinkParams(**raw)
