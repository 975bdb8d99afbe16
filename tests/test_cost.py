"""The α-β-γ cost model: textbook formulas, calibration files, the choice auto makes, and the fit."""

from __future__ import annotations

import json

import pytest

from meshwise.comm.algorithms.choice import SWITCH_MARGIN, choose_algorithm
from meshwise.comm.algorithms.registry import REGISTRY, coefficients, predict_seconds
from meshwise.comm.cost import BUILTIN, Calibration, CostSample, LinkParams, WorldLinks
from meshwise.comm.cost.fit import fit_link_params

LINK = LinkParams(alpha=1e-5, beta=1e-9, gamma=5e-10)


def test_formulas_are_thakur_rabenseifner_gropp():
    n, p = 1 << 20, 8
    assert predict_seconds("all_reduce", "ring", n, p, LINK) == pytest.approx(
        2 * 7 * 1e-5 + 2 * 7 / 8 * n * 1e-9 + 7 / 8 * n * 5e-10
    )
    assert predict_seconds("all_reduce", "rd", n, p, LINK) == pytest.approx(3 * (1e-5 + n * 1e-9 + n * 5e-10))
    assert predict_seconds("all_reduce", "rhd", n, p, LINK) == pytest.approx(
        2 * 3 * 1e-5 + 2 * 7 / 8 * n * 1e-9 + 7 / 8 * n * 5e-10
    )
    assert predict_seconds("broadcast", "tree", n, p, LINK) == pytest.approx(3 * (1e-5 + n * 1e-9))
    assert predict_seconds("all_gather", "ring", n, p, LINK) == pytest.approx(7 * 1e-5 + 7 / 8 * n * 1e-9)
    assert predict_seconds("all_to_all", "pairwise", n, p, LINK) == pytest.approx(7 * 1e-5 + 7 / 8 * n * 1e-9)


def test_every_covered_pair_has_a_cost_and_a_world_of_one_is_free():
    for algo, entry in REGISTRY.items():
        for collective in entry.implements:
            if algo == "hierarchical":
                continue
            assert predict_seconds(collective, algo, 4096, 6, LINK) > 0
            assert predict_seconds(collective, algo, 4096, 1, LINK) == 0
    with pytest.raises(ValueError, match="no single-link cost for broadcast with algo 'ring'"):
        coefficients("broadcast", "ring", 8, 4)
    with pytest.raises(ValueError, match="unknown collective"):
        coefficients("allreduce", "ring", 8, 4)


def test_non_power_of_two_folding_costs_two_extra_steps():
    assert coefficients("all_reduce", "rd", 64, 6)[0] == 2 + 2
    assert coefficients("all_reduce", "rhd", 64, 6)[0] == 2 * 2 + 2


def test_auto_picks_latency_algorithms_small_and_bandwidth_algorithms_large():
    link = LinkParams(alpha=5e-5, beta=1e-9, gamma=3e-10)
    cal = Calibration(link, link, LinkParams(alpha=1e-3, beta=1e-9, gamma=3e-10))
    assert choose_algorithm("all_reduce", 1024, 8, cal) == "rd"
    assert choose_algorithm("all_reduce", 1 << 26, 8, cal, margin=1.0) in ("ring", "rhd")
    assert choose_algorithm("all_reduce", 1 << 26, 64, cal, margin=1.0) == "rhd"  # fewer steps than ring
    assert choose_algorithm("broadcast", 1024, 8, cal) == "tree"
    # native wins ties and whenever it is predicted faster
    fast_native = Calibration(link, link, LinkParams(0.0, 0.0, 0.0))
    assert choose_algorithm("all_reduce", 1 << 20, 8, fast_native) == "native"
    assert choose_algorithm("all_reduce", 1 << 20, 1, cal) == "native"


def test_native_stays_unless_beaten_by_the_margin():
    link = LinkParams(alpha=0.0, beta=1e-9, gamma=0.0)
    ours = predict_seconds("all_reduce", "ring", 1 << 20, 4, link)
    for speedup, expected in ((SWITCH_MARGIN * 0.95, "native"), (SWITCH_MARGIN * 1.05, "ring")):
        native_beta = 1e-9 * speedup * ours / predict_seconds("all_reduce", "native", 1 << 20, 4, link)
        cal = Calibration(link, link, LinkParams(0.0, native_beta, 0.0))
        assert choose_algorithm("all_reduce", 1 << 20, 4, cal, candidates=["ring"]) == expected
        assert choose_algorithm("all_reduce", 1 << 20, 4, cal, candidates=["ring"], margin=1.0) == "ring"


def test_fit_error_is_the_worst_factor_either_way():
    samples = [CostSample("all_reduce", "ring", n, 2, 2e-4) for n in (1024, 4096, 8192)]
    samples.append(CostSample("all_reduce", "ring", 1 << 20, 2, 0.5e-4))  # 4x faster than the others
    fitted, err = fit_link_params(samples)
    worst = max(
        max(p / s.seconds, s.seconds / p)
        for s in samples
        for p in [predict_seconds("all_reduce", "ring", s.nbytes, 2, fitted)]
    )
    assert err == pytest.approx(worst - 1.0) and err > 1.0  # no single α fits both: off by > 2x


def test_hierarchical_wins_when_the_inter_node_link_is_slow():
    fast, slow = LinkParams(1e-6, 1e-11, 1e-11), LinkParams(1e-4, 1e-8, 1e-11)
    cal = Calibration(fast, slow, slow)
    assert choose_algorithm("all_reduce", 1 << 24, 16, cal, local_size=8) == "hierarchical"
    assert choose_algorithm("all_reduce", 1 << 24, 16, cal) != "hierarchical"  # one node: no hierarchy
    # the backend's own collectives keep their calibrated (whole-job) link across nodes too
    quick_native = Calibration(fast, slow, LinkParams(1e-6, 1e-12, 1e-12))
    assert choose_algorithm("broadcast", 1 << 24, 16, quick_native, local_size=8) == "native"
    sluggish_native = Calibration(fast, slow, LinkParams(1e-3, 1e-7, 1e-11))
    # the payload crosses to the other node once (then 3 fast steps inside it), not lg 16 = 4 times
    assert choose_algorithm("broadcast", 1 << 24, 16, sluggish_native, local_size=8) == "hierarchical"
    flat_only = [a for a in REGISTRY if a != "hierarchical"]
    assert (
        choose_algorithm("broadcast", 1 << 24, 16, sluggish_native, local_size=8, candidates=flat_only)
        == "tree"
    )
    with pytest.raises(ValueError, match="must divide"):
        predict_seconds("all_reduce", "hierarchical", 8, 6, fast, inter=slow, local_size=4)


def test_fit_recovers_known_parameters_exactly():
    pairs = (("all_reduce", "ring"), ("all_reduce", "rd"), ("all_gather", "ring"), ("all_reduce", "tree"))
    # classic data (σ = δ = 0): the extra parameters stay exactly zero, they do not share β or α
    truth = LinkParams(alpha=3e-5, beta=2e-9, gamma=7e-10)
    samples = [
        CostSample(c, a, n, p, predict_seconds(c, a, n, p, truth))
        for c, a in pairs[:3]
        for n in (4096, 1 << 20, 1 << 24)
        for p in (2, 4)
    ]
    fitted, err = fit_link_params(samples)
    assert err < 1e-6 and fitted.sigma == 0.0 and fitted.delta == 0.0
    for name in ("alpha", "beta", "gamma"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    # oversubscribed data: exchange steps cost σ and δ more; the one-way tree separates them from α, β
    crowded = LinkParams(alpha=2e-4, beta=1e-9, gamma=1e-9, sigma=7e-4, delta=2e-9)
    samples = [
        CostSample(c, a, n, 4, predict_seconds(c, a, n, 4, crowded))
        for c, a in pairs
        for n in (4096, 1 << 16, 1 << 20, 1 << 24)
    ]
    fitted, err = fit_link_params(samples)
    assert err < 1e-6
    for name in ("alpha", "beta", "gamma", "sigma", "delta"):
        assert getattr(fitted, name) == pytest.approx(getattr(crowded, name), rel=1e-6)


def test_fit_stays_non_negative_on_noisy_data():
    samples = [CostSample("all_reduce", "ring", n, 2, 1e-4 + n * 1e-9) for n in (1024, 4096, 1 << 20)]
    samples.append(CostSample("all_reduce", "ring", 1 << 22, 2, 1e-3))  # an outlier pulling β down
    fitted, err = fit_link_params(samples)
    assert min(fitted.alpha, fitted.beta, fitted.gamma) >= 0 and err > 0
    with pytest.raises(ValueError, match="at least 3 samples"):
        fit_link_params(samples[:2])


def test_calibration_round_trip_defaults_and_bad_files(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cal = Calibration(
        LinkParams(1e-5, 1e-9, 1e-10), LinkParams(2e-5, 2e-9, 1e-10), LinkParams(3e-5, 1e-9, 1e-10)
    )
    cal.save(tmp_path / ".cache/meshwise/calibration.json")  # a file where the old code looked unasked
    builtin = Calibration.from_option(None)
    assert builtin == Calibration.builtin() != cal and builtin.source == BUILTIN  # no hidden input
    written = cal.save("~/cal.json")
    assert written == tmp_path / "cal.json"
    loaded = Calibration.from_option("~/cal.json")
    assert loaded == cal and loaded.source == str(written)  # the run can say what it priced with
    assert Calibration.load(written) == cal and loaded.for_world(2).source == str(written)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"intra": {"alpha": 1}}))
    with pytest.raises(ValueError, match="malformed"):
        Calibration.load(bad)
    with pytest.raises(FileNotFoundError, match="bench --calibrate"):
        Calibration.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="non-negative"):
        LinkParams(-1.0, 0.0, 0.0)


SLOW = LinkParams(alpha=4e-3, beta=1e-9, gamma=5e-10)
FAST = LinkParams(alpha=1e-5, beta=1e-9, gamma=5e-10)


def _per_world() -> Calibration:
    """Top level: a joint fit; 2 ranks: ours fast; 8 ranks (oversubscribed): ours slow."""
    top = Calibration(LINK, LINK, LINK)
    return top.with_world(8, WorldLinks(SLOW, FAST)).with_world(2, WorldLinks(FAST, SLOW))


def test_per_world_calibration_round_trips_and_old_files_still_load(tmp_path):
    cal = _per_world()
    assert [p for p, _ in cal.by_world_size] == [2, 8]  # sorted whatever the insertion order
    path = cal.save(tmp_path / "cal.json")
    raw = json.loads(path.read_text())
    assert sorted(raw["by_world_size"]) == ["2", "8"]
    assert raw["by_world_size"]["8"] == {
        "intra": {"alpha": 4e-3, "beta": 1e-9, "gamma": 5e-10, "sigma": 0.0, "delta": 0.0},
        "native": {"alpha": 1e-5, "beta": 1e-9, "gamma": 5e-10, "sigma": 0.0, "delta": 0.0},
    }
    assert Calibration.load(path) == cal
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"intra": {"alpha": 1e-5, "beta": 1e-9, "gamma": 0.0}}))
    loaded = Calibration.load(old)
    assert loaded.by_world_size == () and loaded.for_world(4) == loaded
    assert "by_world_size" not in json.loads(loaded.save(tmp_path / "again.json").read_text())


def test_for_world_takes_the_exact_then_the_nearest_entry_then_the_top_level():
    cal = _per_world()
    assert cal.for_world(2) == Calibration(FAST, LINK, SLOW)
    assert cal.for_world(8) == Calibration(SLOW, LINK, FAST)
    assert cal.for_world(1).intra == FAST  # nearest: 2
    assert cal.for_world(3).intra == FAST  # |log2 3/2| = 0.58 < |log2 3/8| = 1.42
    assert cal.for_world(4).intra == SLOW  # |log2 4/2| = |log2 4/8| = 1: the tie goes to the larger
    assert cal.for_world(64).intra == SLOW
    assert Calibration(LINK, LINK, LINK).for_world(4) == Calibration(LINK, LINK, LINK)
    assert cal.for_world(4).inter == LINK  # inter stays global
    with pytest.raises(ValueError, match="at least 1"):
        cal.for_world(0)


@pytest.mark.parametrize(
    "entries, message",
    [
        ([], "'by_world_size' must be an object"),
        ({"two": {}}, "invalid literal"),
        ({"0": {"intra": {"alpha": 0, "beta": 0, "gamma": 0}, "native": {"alpha": 0, "beta": 0, "gamma": 0}}},
         "world sizes >= 1"),
        ({"2": {"intra": {"alpha": 1e-5, "beta": 0, "gamma": 0}}}, "'native'"),
        ({"2": 5}, r"by_world_size\['2'\] must be an object"),
    ],
)  # fmt: skip
def test_malformed_per_world_entries_are_refused_clearly(tmp_path, entries, message):
    bad = tmp_path / "bad.json"
    top = {"alpha": 1e-5, "beta": 1e-9, "gamma": 0.0}
    bad.write_text(json.dumps({"intra": top, "by_world_size": entries}))
    with pytest.raises(ValueError, match="malformed") as info:
        Calibration.load(bad)
    assert info.match(message) and "re-run `meshwise bench --calibrate`" in str(info.value)


def test_auto_prices_with_the_entry_for_its_world_size():
    # on 2 ranks our algorithms are cheap and native slow: rd wins; on 8 ranks the reverse keeps native
    cal = _per_world()
    assert choose_algorithm("all_reduce", 4096, 2, cal) == "rd"
    assert choose_algorithm("all_reduce", 4096, 8, cal) == "native"
    assert choose_algorithm("all_reduce", 4096, 2, Calibration(SLOW, SLOW, FAST)) == "native"  # top level
