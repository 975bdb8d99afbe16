"""``TwoLevelCommunicator``: one Communicator over several nodes, one transport per level.

Inside a node the ranks share memory, so the intra-node level is the shared-memory backend; between
nodes the inter-node level is torch.distributed (gloo on CPUs). The flat transport over the whole job
(the same torch.distributed group) stays for whatever the hierarchy does not do better: point-to-point,
barriers, rooted and all-to-all collectives, and every all_reduce / all_gather / broadcast the cost model
predicts the flat collective wins (small messages on a fast network pay two levels' latencies for
nothing). That choice is ``choose_algorithm`` between ``native`` (the flat collective) and
``hierarchical``, priced with the calibration's two-level links (:meth:`Calibration.two_level`), with no
margin: both candidates are the transports' own collectives, neither runs our Python executor.

The node map comes from the launcher's node ranks (:mod:`meshwise.comm.topology`), never the hostname.
Nodes holding different numbers of ranks have no two-level all-reduce; then every collective is flat and
:attr:`TwoLevelCommunicator.levels` says so.

On GPUs there is no such composite: NCCL already rings inside a node over NVLink and across nodes over
the network, so ``backend="auto"`` means ``nccl`` there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from meshwise.comm.algorithms.choice import cached_level_split
from meshwise.comm.algorithms.communicator import DEFAULT_SEGMENT_BYTES, AlgorithmCommunicator
from meshwise.comm.algorithms.hierarchical import Hierarchy, split_levels
from meshwise.comm.api import Communicator
from meshwise.comm.cost.calibration import Calibration
from meshwise.comm.native import NativeCommunicator
from meshwise.comm.topology import Topology, gather_node_map
from meshwise.runtime.env import detect_launch_env
from meshwise.runtime.timeouts import DEFAULT_TIMEOUT_S

#: what ``policy`` accepts: per call by the model, always the hierarchy, or always flat
POLICIES = ("auto", "hierarchical", "flat")


class TwoLevelCommunicator(AlgorithmCommunicator):
    """Collectives over ``flat`` (the inter-node transport over every rank), with all_reduce, all_gather
    and broadcast run through ``hierarchy`` (intra-node transport, then inter-node) where ``policy``
    says so."""

    #: the hierarchical collectives run to completion on the calling thread (shared memory does the
    #: copies), so DDP launches its buckets once backward ends rather than blocking backward on each
    overlaps_compute = False

    def __init__(
        self,
        flat: Communicator,
        topology: Topology,
        hierarchy: Hierarchy | None,
        *,
        calibration: Calibration | None = None,
        policy: str = "auto",
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    ) -> None:
        """``segment_bytes``: the hierarchical all_reduce crosses between nodes in pieces of about this
        many bytes per rank, the next piece's intra-node phase overlapping the previous one's transfer."""
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is unknown; choose one of {', '.join(POLICIES)}")
        if policy == "hierarchical" and hierarchy is None:
            raise ValueError(
                f"policy 'hierarchical' needs the same number of ranks on every node; the nodes hold "
                f"{[len(m) for m in topology.members]}"
            )
        pricing = calibration if calibration is not None else Calibration.builtin()
        super().__init__(
            flat,
            _algorithm(policy, hierarchy),
            hierarchy=hierarchy,
            calibration=pricing.two_level(),
            segment_bytes=segment_bytes,
        )
        self.pricing = pricing  # what a split prices with (``calibration`` holds the derived links)
        self.topology = topology
        self.policy = policy
        intra = hierarchy.intra.backend if hierarchy is not None else None
        self.levels = {"intra": intra or "-", "inter": hierarchy.inter.backend if hierarchy else flat.backend}
        self.backend = f"{intra}+{flat.backend}" if intra is not None else flat.backend

    def __repr__(self) -> str:
        return (
            f"TwoLevelCommunicator(rank={self.rank}, nodes={self.topology.nodes}, "
            f"backend={self.backend!r}, policy={self.policy!r})"
        )

    def describe_levels(self) -> str:
        """Which transport serves each level, for ``meshwise info`` and the benchmarks' output."""
        if self.hierarchy is None:
            sizes = [len(m) for m in self.topology.members]
            return f"flat {self.levels['inter']} (nodes hold {sizes} ranks: no two-level collectives)"
        local, nodes = self.hierarchy.local_size, self.topology.nodes
        if nodes == 1:
            return f"intra-node {self.levels['intra']} ({local} ranks on one node)"
        if local == 1:
            return f"inter-node {self.levels['inter']} ({nodes} nodes, one rank on each)"
        return (
            f"intra-node {self.levels['intra']} ({local} ranks per node), "
            f"inter-node {self.levels['inter']} ({nodes} nodes), flat {self.base.backend}"
        )

    @classmethod
    def from_process_group(
        cls,
        group: dist.ProcessGroup | None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        node_map: Sequence[int] | None = None,
        intra: str = "shm",
        calibration: Calibration | None = None,
        policy: str = "auto",
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    ) -> TwoLevelCommunicator:
        """Build both levels over ``group`` (a collective call). ``node_map`` (one node id per rank of
        the group) overrides the launcher's node ranks, which is how tests stand one host in for several
        nodes; ``intra`` is the intra-node backend (``shm``, or ``gloo`` where shared memory is not
        wanted)."""
        flat = NativeCommunicator(group, timeout=timeout)
        topology = (
            Topology(tuple(node_map)) if node_map is not None else gather_node_map(detect_launch_env(), group)
        )
        if topology.world_size != flat.world_size:
            raise ValueError(
                f"[rank {flat.rank} · two-level] node_map has {topology.world_size} entries; need one node "
                f"id per rank ({flat.world_size})"
            )
        hierarchy = build_hierarchy(flat, topology, intra)
        return cls(
            flat, topology, hierarchy, calibration=calibration, policy=policy, segment_bytes=segment_bytes
        )

    def _split(self, ranks: list[int]) -> Communicator | None:
        """The sub-group as a two-level communicator of its own (a single node's group then runs
        everything on the intra-node transport, a group of one rank per node on the inter-node one)."""
        sub = self.base.split(ranks)
        if sub is None:
            return None
        topology = self.topology.subset(ranks)
        intra = self.levels["intra"] if self.levels["intra"] != "-" else "gloo"
        wrapper = TwoLevelCommunicator(
            sub,
            topology,
            build_hierarchy(sub, topology, intra),
            calibration=self.pricing,
            policy=self.policy,
            segment_bytes=self.segment_bytes,
        )
        wrapper._owned.append(sub)
        return wrapper

    def choose(self, collective: str, nbytes: int) -> str:
        """``native`` (flat) or ``hierarchical`` for this call; every rank reaches the same answer from
        the same size and calibration."""
        if self.algo != "auto":
            return super().choose(collective, nbytes)
        assert self.hierarchy is not None  # "auto" only with a hierarchy (see _algorithm)
        return cached_level_split(
            collective, nbytes, self.world_size, self.hierarchy.local_size, self.pricing
        )


def _algorithm(policy: str, hierarchy: Hierarchy | None) -> str:
    """The algorithm name behind ``policy``. ``auto`` needs no model in two cases: a single node's group
    runs everything on the fast transport, and one rank per node has nothing to gain from a hierarchy."""
    if hierarchy is None or policy == "flat":
        return "native"
    if policy == "auto" and hierarchy.local_size == 1:
        return "native"
    return "hierarchical" if hierarchy.nodes == 1 else policy


def build_hierarchy(flat: NativeCommunicator, topology: Topology, intra: str) -> Hierarchy | None:
    """The node group on ``intra``'s transport and the cross-node group on ``flat``'s, or None where the
    nodes hold different numbers of ranks (a collective call over ``flat``)."""
    if not topology.uniform:
        return None
    node_group, across = split_levels(flat, topology)
    levels: list[Communicator] = [node_group, across]
    if intra == "shm" and node_group.world_size > 1 and isinstance(node_group, NativeCommunicator):
        from meshwise.comm.shm import ShmCommunicator  # maps /dev/shm segments: only when asked for

        levels[0] = ShmCommunicator.from_process_group(node_group.group, timeout=flat.timeout)
        levels.append(node_group)  # its process group carries the shared-memory bootstrap: closed last
    return Hierarchy(topology, flat.rank, levels[0], levels[1], owned=levels)
