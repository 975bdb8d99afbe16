"""Hierarchical all-reduce for clusters: reduce-scatter inside each node, all-reduce of the shards
between nodes (rank i of every node talks only to rank i of the others), all-gather inside each node.

Only 1/L of the vector crosses the slow inter-node link per rank (L = ranks per node) and all L local
ranks use the inter-node network in parallel — the seeds' NCCL-style two-level scheme. The node map
comes from the runtime (hostnames per rank) or, in tests, from an explicit list on one machine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from meshwise.comm.algorithms.plan import even_bounds
from meshwise.comm.api import Communicator, ReduceOp


class Hierarchy:
    """The intra-node and inter-node sub-communicators of one rank, built once from a node map.

    ``wrap(base, algo)`` turns a sub-communicator into an algorithm communicator (injected so that this
    module does not import the wrapper that imports it).
    """

    def __init__(
        self,
        comm: Communicator,
        node_map: Sequence[int],
        wrap: Callable[[Communicator, str], Communicator],
    ) -> None:
        node_map = list(node_map)
        if len(node_map) != comm.world_size:
            raise ValueError(
                f"[rank {comm.rank} · hierarchical] node_map has {len(node_map)} entries; need one node id "
                f"per rank ({comm.world_size})"
            )
        nodes = list(dict.fromkeys(node_map))
        members = [[r for r in range(comm.world_size) if node_map[r] == node] for node in nodes]
        sizes = {len(m) for m in members}
        if len(sizes) != 1:
            raise ValueError(
                f"[rank {comm.rank} · hierarchical] nodes hold different numbers of ranks "
                f"({[len(m) for m in members]}); hierarchical all_reduce needs the same count on every node"
            )
        self.local_size = sizes.pop()
        self.nodes = len(nodes)
        mine = members[nodes.index(node_map[comm.rank])]
        self.local_rank = mine.index(comm.rank)
        intra = inter = None
        for group in members:  # every rank takes part in every split, in the same order
            sub = comm.split(group)
            intra = sub if sub is not None else intra
        for i in range(self.local_size):
            sub = comm.split([group[i] for group in members])
            inter = sub if sub is not None else inter
        assert intra is not None and inter is not None
        self._subgroups = (intra, inter)
        self.intra = wrap(intra, "ring")
        self.inter = wrap(inter, "auto")

    def close(self) -> None:
        """Release the sub-communicators this hierarchy split off."""
        for sub in self._subgroups:
            sub.close()

    def all_reduce(self, data: torch.Tensor, op: ReduceOp) -> None:
        """Reduce the flat ``data`` in place (AVG is the caller's business: pass SUM and divide)."""
        bounds = even_bounds(data.numel(), self.local_size)
        slots = [data[bounds[i] : bounds[i + 1]] for i in range(self.local_size)]
        shard = torch.empty_like(slots[self.local_rank])
        self.intra.reduce_scatter(shard, slots, op)
        self.inter.all_reduce(shard, op)
        self.intra.all_gather(slots, shard)
