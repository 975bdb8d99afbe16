"""Which ranks share a node: the node map, from the launcher's word or gathered from the ranks.

Node identity comes from the *node rank* the launcher assigns (torchrun's GROUP_RANK, which ``meshwise
run --node-rank`` exports), never from the hostname: two network namespaces, two containers or two
cloned VMs report the same hostname yet are different nodes as far as the network is concerned, and a
map built from hostnames would send inter-node traffic through shared memory that does not exist.

Everything here is plain data except :func:`gather_node_map`, which asks the other ranks for their node
ranks through the control plane (a launcher need not number ranks node by node, so no rank can infer the
map from its own environment alone). A test, or a script that knows better, passes an explicit node map
instead (``meshwise.init(node_map=[0, 0, 1, 1])``), which is how one host stands in for several nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from meshwise.runtime.env import LaunchEnv


@dataclass(frozen=True)
class Topology:
    """The node id of every rank, and what follows from it. Node ids are labels: any integers, in any
    order; nodes are numbered by first appearance, and a node's members keep their rank order."""

    node_of: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.node_of:
            raise ValueError("a node map needs one node id per rank; got none")
        object.__setattr__(self, "node_of", tuple(int(n) for n in self.node_of))

    @property
    def world_size(self) -> int:
        return len(self.node_of)

    @property
    def node_ids(self) -> tuple[int, ...]:
        """The distinct node ids, in order of first appearance."""
        return tuple(dict.fromkeys(self.node_of))

    @property
    def nodes(self) -> int:
        return len(self.node_ids)

    @property
    def members(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of each node (by :attr:`node_ids` order), ascending."""
        return tuple(tuple(r for r, n in enumerate(self.node_of) if n == node) for node in self.node_ids)

    @property
    def uniform(self) -> bool:
        """Whether every node holds the same number of ranks (what the two-level collectives need)."""
        return len({len(m) for m in self.members}) == 1

    @property
    def local_size(self) -> int:
        """Ranks per node (L); ValueError when nodes differ, which no single L describes."""
        if not self.uniform:
            raise ValueError(
                f"nodes hold different numbers of ranks ({[len(m) for m in self.members]}); there is no "
                "single ranks-per-node count"
            )
        return len(self.members[0])

    def node_index(self, rank: int) -> int:
        """Which node (0 … nodes−1, by :attr:`node_ids` order) ``rank`` sits on."""
        return self.node_ids.index(self.node_of[rank])

    def local_rank(self, rank: int) -> int:
        """``rank``'s position among the ranks of its node."""
        return self.members[self.node_index(rank)].index(rank)

    def peers_across(self, rank: int) -> tuple[int, ...]:
        """The ranks at ``rank``'s local position on every node, in node order: the inter-node group
        ``rank`` belongs to in the two-level collectives (uniform nodes only)."""
        local = self.local_rank(rank)
        return tuple(group[local] for group in self.members if local < len(group))

    def subset(self, ranks: Sequence[int]) -> Topology:
        """The topology of the group made of ``ranks`` (new rank i = ``ranks[i]``)."""
        return Topology(tuple(self.node_of[r] for r in ranks))


def gather_node_map(layout: LaunchEnv, group: dist.ProcessGroup | None = None) -> Topology:
    """The job's node map: every rank's node rank as its launcher gave it (``layout.node_rank``: GROUP_RANK
    under torchrun's contract, rank // LOCAL_WORLD_SIZE where the launcher only gave the local layout),
    gathered over ``group`` through the control plane. A collective call: every rank of the group makes
    it, always, so that no rank waits for a gather the others decided to skip."""
    ranks: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(ranks, layout.node_rank, group=group)
    return Topology(tuple(ranks))
