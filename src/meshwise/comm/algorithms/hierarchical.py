"""Hierarchical collectives for clusters: the slow inter-node link carries as little as possible.

* all_reduce: reduce-scatter inside each node, all-reduce of the shards between nodes (rank i of every
  node talks only to rank i of the others), all-gather inside each node. Only 1/L of the vector crosses
  the inter-node link per rank (L = ranks per node) and all L local ranks use it in parallel — the
  seeds' NCCL-style two-level scheme.
* all_gather: each rank first gathers the slots of its counterparts on the other nodes (1/p of the data
  per message across nodes), then the node exchanges those columns over the fast link.
* broadcast: the root's counterparts on the other nodes receive it across nodes, then each of them
  broadcasts inside its node; the payload crosses to each node once, not once per rank.

The two levels are any two communicators: :meth:`Hierarchy.split` carves both out of one (our algorithms
over one transport), and :mod:`meshwise.comm.two_level` hands in a different transport per level (shared
memory inside a node, gloo or NCCL across). The node map comes from the launcher's node ranks
(:mod:`meshwise.comm.topology`) or, in tests, from an explicit list on one machine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from meshwise.comm.algorithms.plan import even_bounds
from meshwise.comm.api import Communicator, ReduceOp
from meshwise.comm.topology import Topology


class Hierarchy:
    """One rank's node communicator (``intra``, rank = local rank) and cross-node communicator
    (``inter``, rank = node index), over a topology whose nodes all hold the same number of ranks."""

    def __init__(
        self,
        topology: Topology,
        rank: int,
        intra: Communicator,
        inter: Communicator,
        owned: Sequence[Communicator] = (),
    ) -> None:
        self.topology = topology
        self.local_size = topology.local_size
        self.nodes = topology.nodes
        self.local_rank = topology.local_rank(rank)
        self.node = topology.node_index(rank)
        if (intra.world_size, intra.rank) != (self.local_size, self.local_rank):
            raise ValueError(f"intra communicator {intra!r} is not rank {rank}'s node group")
        if (inter.world_size, inter.rank) != (self.nodes, self.node):
            raise ValueError(f"inter communicator {inter!r} is not rank {rank}'s cross-node group")
        self.intra = intra
        self.inter = inter
        self._owned = list(owned)

    @classmethod
    def split(
        cls,
        comm: Communicator,
        node_map: Sequence[int],
        wrap: Callable[[Communicator, str], Communicator],
    ) -> Hierarchy:
        """Both levels split off ``comm`` itself; ``wrap(sub, algo)`` turns each into an algorithm
        communicator (injected so that this module does not import the wrapper that imports it)."""
        topology = Topology(tuple(node_map))
        if topology.world_size != comm.world_size:
            raise ValueError(
                f"[rank {comm.rank} · hierarchical] node_map has {topology.world_size} entries; need one "
                f"node id per rank ({comm.world_size})"
            )
        if not topology.uniform:
            raise ValueError(
                f"[rank {comm.rank} · hierarchical] nodes hold different numbers of ranks "
                f"({[len(m) for m in topology.members]}); hierarchical collectives need the same count "
                "on every node"
            )
        intra, inter = split_levels(comm, topology)
        return cls(topology, comm.rank, wrap(intra, "ring"), wrap(inter, "auto"), owned=(intra, inter))

    def close(self) -> None:
        """Release the sub-communicators this hierarchy was handed or split off."""
        for sub in self._owned:
            sub.close()

    def all_reduce(self, data: torch.Tensor, op: ReduceOp, pieces: int = 1) -> None:
        """Reduce the flat ``data`` in place (AVG is the caller's business: pass SUM and divide).

        With ``pieces`` > 1 the vector is cut into that many consecutive pieces and the levels overlap:
        piece k+1 is reduce-scattered inside the node while piece k crosses between nodes (the inter-node
        all_reduce is launched asynchronously), and the all-gathers run while later pieces are still in
        flight — so a large vector costs about the slow link's time plus one piece of the fast one's,
        not their sum."""
        handles = []
        for piece in data.tensor_split(max(1, min(pieces, data.numel()))):
            bounds = even_bounds(piece.numel(), self.local_size)
            slots = [piece[bounds[i] : bounds[i + 1]] for i in range(self.local_size)]
            shard = torch.empty_like(slots[self.local_rank])
            self.intra.reduce_scatter(shard, slots, op)
            handles.append((self.inter.all_reduce(shard, op, async_op=True), slots, shard))
        for work, slots, shard in handles:
            if work is not None:
                work.wait()
            self.intra.all_gather(slots, shard)

    def all_gather(self, outputs: list[torch.Tensor], input: torch.Tensor) -> None:
        """Rank r's ``input`` into ``outputs[r]`` on every rank (slots may differ in size)."""
        members = self.topology.members
        across = [outputs[node[self.local_rank]] for node in members]
        self.inter.all_gather(across, input)
        columns = [
            torch.empty(
                sum(outputs[node[j]].numel() for node in members), dtype=input.dtype, device=input.device
            )
            for j in range(self.local_size)
        ]
        columns[self.local_rank] = torch.cat([slot.reshape(-1) for slot in across])
        self.intra.all_gather(columns, columns[self.local_rank])
        for j, column in enumerate(columns):
            if j != self.local_rank:
                pieces = column.split([outputs[node[j]].numel() for node in members])
                for node, piece in zip(members, pieces, strict=True):
                    outputs[node[j]].view(-1).copy_(piece)

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """``root``'s (a rank of the whole group) tensor onto every rank, crossing to each node once."""
        root_local = self.topology.local_rank(root)
        if self.local_rank == root_local:
            self.inter.broadcast(tensor, self.topology.node_index(root))
        self.intra.broadcast(tensor, root_local)


def split_levels(comm: Communicator, topology: Topology) -> tuple[Communicator, Communicator]:
    """This rank's node group and cross-node group, split off ``comm`` (a collective call: every rank
    takes part in every split, in the same order)."""
    intra = member_split(comm, topology.members)
    across = [tuple(node[i] for node in topology.members) for i in range(topology.local_size)]
    inter = member_split(comm, across)
    return intra, inter


def member_split(comm: Communicator, groups: Sequence[Sequence[int]]) -> Communicator:
    """This rank's group among ``groups``, which partition the ranks (every rank calls split for every
    group, in the same order).

    That every rank joins exactly one group matters beyond this call: torch names a locally synchronised
    group by its ranks *and the number of groups this process has registered*, so a split that only some
    ranks join (say, one rank per node) leaves the others one behind, and the next group they share
    waits for a key nobody writes — a hang, not an error."""
    mine = None
    for group in groups:
        sub = comm.split(list(group))
        mine = sub if sub is not None else mine
    if mine is None:
        raise ValueError(f"[rank {comm.rank} · hierarchical] rank is in none of the groups {groups}")
    return mine
