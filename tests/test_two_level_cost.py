"""The two-level cost model and the flat-or-hierarchical choice, as plain data (no processes)."""

from __future__ import annotations

import pytest

from meshwise.bench.calibrate import LEVEL_PLANS, merge_fit
from meshwise.comm.algorithms.choice import choose_level_split
from meshwise.comm.algorithms.registry import predict_seconds
from meshwise.comm.cost import Calibration, CostSample, Levels, LinkParams
from meshwise.comm.cost.fit import fit_link_params
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


# ---------------------------------------------------------------------------- token buckets and plans
#: a 1 Gbit/s link shaped by a token bucket: 300 µs per message, 8 ns per byte, 600 kB of credit per call
BUCKET = LinkParams(3e-4, GBIT, 0.0, burst=600e3)
CALIBRATION_SIZES = [4096 << (2 * k) for k in range(7)]  # 4 KiB … 16 MiB, as the benchmark


def test_a_token_bucket_link_charges_beta_only_past_its_credit():
    below = (2.0, 500e3, 0.0, 0.0, 0.0)
    above = (2.0, 1.6e6, 0.0, 0.0, 0.0)
    assert BUCKET.seconds(below) == pytest.approx(2 * 3e-4)
    assert BUCKET.seconds(above) == pytest.approx(2 * 3e-4 + 1.0e6 * GBIT)
    assert LinkParams(3e-4, GBIT, 0.0).seconds(above) == pytest.approx(2 * 3e-4 + 1.6e6 * GBIT)
    with pytest.raises(ValueError, match="burst"):
        LinkParams(0.0, 0.0, 0.0, burst=-1.0)


def _samples(plan, truth, p):
    """What a level's calibration records when the link behaves as ``truth(collective, n)``."""
    return [CostSample(c, "native", n, p, truth(c, n)) for c in plan for n in CALIBRATION_SIZES]


def test_the_fit_finds_a_token_bucket_that_a_plain_alpha_beta_fit_misses():
    truth = lambda c, n: predict_seconds(c, "native", n, 4, BUCKET)  # noqa: E731
    samples = _samples(("all_reduce", "all_gather"), truth, 4)
    fitted, error = fit_link_params(samples, burst=True)
    assert error < 0.02
    assert fitted.beta == pytest.approx(GBIT, rel=0.02) and fitted.alpha == pytest.approx(3e-4, rel=0.05)
    for n in (64 << 10, 512 << 10, 32 << 20):  # sizes the fit did not see
        predicted = predict_seconds("all_reduce", "native", n, 4, fitted)
        assert predicted == pytest.approx(truth("all_reduce", n), rel=0.05)
    plain, plain_error = fit_link_params(samples)
    assert plain.burst == 0.0 and plain_error > 0.3  # a straight line cannot bend at the credit


def test_the_network_levels_are_calibrated_without_gloos_reduce_scatter():
    """gloo runs reduce_scatter as an all_reduce of the whole buffer (as long as it, measured): priced
    as a ring reduce-scatter those samples contradict the all_reduce ones, and the fit's compromise
    misprices all_reduce. The levels are measured on the collectives they run, so the fit stays exact."""
    link = LinkParams(3e-4, GBIT, 1e-10)

    def gloo(collective, n):
        shape = "all_reduce" if collective == "reduce_scatter" else collective
        return predict_seconds(shape, "native", n, 4, link)

    for level in ("inter", "flat"):
        assert "reduce_scatter" not in LEVEL_PLANS[level]
        fitted, _ = fit_link_params(_samples(LEVEL_PLANS[level], gloo, 4), burst=True)
        assert predict_seconds("all_reduce", "native", 16 << 20, 4, fitted) == pytest.approx(
            gloo("all_reduce", 16 << 20), rel=0.02
        )
    skewed, error = fit_link_params(_samples(("all_reduce", "all_gather", "reduce_scatter"), gloo, 4))
    off = predict_seconds("all_reduce", "native", 16 << 20, 4, skewed) / gloo("all_reduce", 16 << 20)
    assert error > 0.2 and max(off, 1 / off) > 1.2


def test_the_hierarchy_prices_the_inter_node_call_with_its_bucket():
    """Across nodes the hierarchy makes one all_reduce of n/L per rank: a shard under the credit pays
    only latency there, a large one pays β on what exceeds it."""
    inter = LinkParams(3e-4, 2 * GBIT, 0.0, burst=300e3)
    world, local = 4, 2

    def across(n):
        return predict_seconds("all_reduce", "hierarchical", n, world, FREE, inter=inter, local_size=local)

    assert across(256 << 10) == pytest.approx(2 * 3e-4)  # ring of 2 nodes on a 128 KiB shard: 2 messages
    n = 32 << 20
    assert across(n) == pytest.approx(2 * 3e-4 + (n / 2 - 300e3) * 2 * GBIT)


def test_a_links_credit_survives_the_file(tmp_path):
    levels = Levels(intra=SLOW_NETWORK.intra, inter=BUCKET, flat=LinkParams(2e-4, GBIT, 0.0, burst=1e5))
    path = Calibration.builtin().with_levels(levels).save(tmp_path / "cal.json")
    assert Calibration.load(path).levels == levels
    assert "burst" not in path.read_text().split('"levels"')[0]  # plain links keep their old form


def test_each_hand_over_between_the_levels_is_priced_and_can_tip_the_choice(tmp_path):
    """all_reduce hands over twice (into the inter-node call and out), all_gather and broadcast once;
    a layout with one level has none. A costly hand-over keeps small messages flat."""
    link = LinkParams(1e-4, GBIT, 0.0)
    n = 64 << 10

    def extra(collective, world, local):
        def price(switch):
            return predict_seconds(
                collective, "hierarchical", n, world, link, inter=link, local_size=local, switch=switch
            )

        return price(1e-3) - price(0.0)

    assert extra("all_reduce", 4, 2) == pytest.approx(2e-3)
    assert extra("all_gather", 4, 2) == pytest.approx(1e-3)
    assert extra("broadcast", 4, 2) == pytest.approx(1e-3)
    assert extra("all_reduce", 2, 1) == 0.0 and extra("all_reduce", 2, 2) == 0.0
    slow_hand_over = Levels(SLOW_NETWORK.intra, SLOW_NETWORK.inter, SLOW_NETWORK.flat, switch=0.05)
    cal = Calibration.builtin().with_levels(slow_hand_over)
    assert choose_level_split("all_reduce", 4096, 4, 2, cal) == "native"
    assert choose_level_split("all_reduce", 256 << 20, 4, 2, cal) == "hierarchical"
    assert Calibration.load(cal.save(tmp_path / "cal.json")).levels == slow_hand_over
