"""The two-level cost model and the flat-or-hierarchical choice, as plain data (no processes)."""

from __future__ import annotations

import pytest

from meshwise.bench.calibrate import merge_fit
from meshwise.comm.algorithms.choice import choose_level_split
from meshwise.comm.algorithms.registry import predict_seconds
from meshwise.comm.cost import Calibration, Levels, LinkParams
from meshwise.comm.factory import transport_levels

GBIT = 8e-9 / 1.0  # seconds per byte of a 1 Gbit/s link
FREE = LinkParams(0.0, 0.0, 0.0)


@pytest.mark.parametrize("local", [1, 2, 4, 8])
def test_hierarchical_is_two_minus_one_over_l_times_a_flat_ring_on_a_link_bound_network(local):
    """DESIGN fact. Two nodes joined by one link, everything else free: a flat ring moves 2(p−1)/p·n
    over it; the hierarchy moves 2·(1/2)·(n/L) per rank, L ranks sharing the link (β per rank L×)."""
    flat = LinkParams(0.0, GBIT, 0.0)
    shared = LinkParams(0.0, local * GBIT, 0.0)
    n, world = 64 << 20, 2 * local
    ring = predict_seconds("all_reduce", "native", n, world, flat)
    two_level = predict_seconds("all_reduce", "hierarchical", n, world, FREE, inter=shared, local_size=local)
    assert ring / two_level == pytest.approx(2 - 1 / local)


#: 2 nodes × 2 ranks behind a 1 Gbit/s link: shm inside (tens of µs, GB/s), gloo across
SLOW_NETWORK = Levels(
    intra=LinkParams(3e-5, 3e-10, 2e-10),
    inter=LinkParams(2e-4, 2 * GBIT, 2e-10),
    flat=LinkParams(2e-4, GBIT, 2e-10),
)
#: a network as fast as the node's memory and a sluggish intra-node transport: the hierarchy only adds
FAST_NETWORK = Levels(
    intra=LinkParams(5e-4, 1e-9, 2e-10),
    inter=LinkParams(1e-5, 2e-10, 2e-10),
    flat=LinkParams(1e-5, 1e-10, 2e-10),
)
SIZES = [1 << k for k in range(10, 27, 2)]


def _choices(levels: Levels, collective: str = "all_reduce") -> set[str]:
    cal = Calibration.builtin().with_levels(levels)
    return {choose_level_split(collective, n, 4, 2, cal) for n in SIZES}


def test_auto_takes_the_hierarchy_behind_a_slow_link_and_stays_flat_behind_a_fast_one():
    for collective in ("all_reduce", "all_gather"):
        assert _choices(SLOW_NETWORK, collective) == {"hierarchical"}, collective
    for collective in ("all_reduce", "all_gather", "broadcast"):
        assert _choices(FAST_NETWORK, collective) == {"native"}, collective


def test_the_choice_follows_the_predicted_crossover():
    # the hierarchy pays the intra-node α twice; flat pays the network's α 2(p-1) times: with a cheap
    # α and a costly β across, small messages stay flat and large ones go hierarchical
    levels = Levels(
        intra=LinkParams(4e-4, 1e-10, 1e-10),
        inter=LinkParams(1e-6, 2e-9, 1e-10),
        flat=LinkParams(1e-6, 1e-9, 1e-10),
    )
    cal = Calibration.builtin().with_levels(levels)
    picks = [choose_level_split("all_reduce", n, 4, 2, cal) for n in SIZES]
    assert picks[0] == "native" and picks[-1] == "hierarchical"
    assert picks == sorted(picks, key=lambda p: p == "hierarchical")  # one switch, small to large
    for n, pick in zip(SIZES, picks, strict=True):
        flat = predict_seconds("all_reduce", "native", n, 4, levels.flat)
        hier = predict_seconds(
            "all_reduce", "hierarchical", n, 4, levels.intra, inter=levels.inter, local_size=2
        )
        assert pick == ("hierarchical" if hier < flat else "native")


def test_levels_survive_the_file_a_world_size_lookup_and_a_later_single_node_fit(tmp_path):
    cal = Calibration.builtin().with_levels(SLOW_NETWORK)
    path = cal.save(tmp_path / "cal.json")
    loaded = Calibration.load(path)
    assert loaded.levels == SLOW_NETWORK
    assert loaded.for_world(4).levels == SLOW_NETWORK
    link = LinkParams(1e-5, 1e-9, 1e-9)
    assert merge_fit(loaded, 2, link, link, link).levels == SLOW_NETWORK  # one node measures no levels
    assert Calibration.builtin().levels is None  # the built-in levels apply until calibrated
    assert Calibration.builtin().two_level().native != loaded.two_level().native


def test_transports_are_named_per_level():
    assert transport_levels("shm+gloo", 2) == {"intra-node": "shm", "inter-node": "gloo"}
    assert transport_levels("nccl", 2) == {"intra-node": "nccl", "inter-node": "nccl"}
    assert transport_levels("shm", 1) == {"intra-node": "shm", "inter-node": "-"}


def test_auto_resolves_to_shm_plus_gloo_only_for_cpu_ranks_over_several_nodes():
    import torch

    from meshwise.world import resolve_backend

    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, 4, ranks_per_node=2) == "shm+gloo"
    assert resolve_backend("auto", cpu, 4, single_host=True) == "shm"
    assert resolve_backend("auto", cpu, 2, ranks_per_node=1) == "gloo"  # one rank per node: nothing to share
    assert resolve_backend("auto", cpu, 4) == "gloo"  # nodes of different sizes
    with pytest.raises(ValueError, match="moves CPU tensors"):
        resolve_backend("shm+gloo", torch.device("cuda", 0), 4)
