"""`meshwise scale`: the seeds' speedup/efficiency arithmetic, ratings, causes, the output parser, toy
commands with known times, the cost-model line, and a real (tiny) π study on spawned ranks."""

import json
import math
import sys
import types

import pytest

from meshwise.cli import main
from meshwise.scale.metrics import Sample, ScalePoint, analyse, classify, karp_flatt, speedup_efficiency
from meshwise.scale.model import predicted_times
from meshwise.scale.report import format_table, plot
from meshwise.scale.runner import parse_output, parse_workload

SEEDS_EXERCISE_2 = {1: 45.212765, 2: 22.608870, 4: 11.409895}
SEEDS_EXERCISE_4 = {1: 45.151563, 2: 22.624692, 4: 11.396042, 8: 5.748150}


def _points(times, mode="strong", cores=None):
    return analyse(mode, {n: [Sample(t)] for n, t in times.items()}, cores)


def test_strong_scaling_arithmetic_against_the_seeds_table():
    points = {p.ranks: p for p in _points(SEEDS_EXERCISE_2)}
    assert (points[1].speedup, points[1].efficiency) == (1.0, 1.0)
    assert f"{points[4].speedup:.4f}" == "3.9626" and f"{points[4].efficiency:.4f}" == "0.9906"
    # T(1)/T(2) = 1.99978: the seeds print 1.9996 / 0.9998 for this row, 2e-4 off their own times.
    assert points[2].speedup == pytest.approx(45.212765 / 22.608870, rel=1e-12)
    assert points[2].speedup == pytest.approx(1.9996, abs=3e-4)
    assert points[2].efficiency == pytest.approx(0.9998, abs=2e-4)
    assert all(p.rating == "excellent" and not p.causes for p in points.values())
    eight = _points(SEEDS_EXERCISE_4)[-1]
    assert f"{eight.efficiency:.3f}" == "0.982"  # the E(8) for NCCL Monte Carlo


def test_table_prints_the_seeds_columns():
    table = format_table("strong", _points(SEEDS_EXERCISE_2), unit="GPUs")
    rows = table.splitlines()
    assert rows[0].split()[:6] == ["GPUs", "Wall", "time", "(s)", "Speedup", "Parallel"]
    assert rows[3].split()[:4] == ["4", "11.409895", "3.9626", "0.9906"]


def test_baseline_above_one_rank_assumes_it_is_perfectly_efficient():
    points = _points({2: 10.0, 4: 5.0, 8: 4.0})
    assert [p.speedup for p in points] == [2.0, 4.0, 5.0]
    assert [p.efficiency for p in points] == [1.0, 1.0, 0.625]


def test_weak_scaling_uses_scaled_efficiency():
    points = _points({1: 10.0, 2: 10.5, 4: 12.5}, mode="weak")
    assert [p.efficiency for p in points] == pytest.approx([1.0, 10 / 10.5, 0.8])
    assert [p.speedup for p in points] == pytest.approx([1.0, 20 / 10.5, 3.2])
    assert [p.rating for p in points] == ["excellent", "excellent", "good"]
    assert points[2].serial_fraction is None


@pytest.mark.parametrize(
    ("efficiency", "rating"),
    [
        (0.951, "excellent"),
        (0.95, "good"),
        (0.80, "good"),
        (0.7999, "acceptable"),
        (0.60, "acceptable"),
        (0.59, "poor"),
    ],
)
def test_seed_bands(efficiency, rating):
    assert classify(efficiency) == rating


def test_karp_flatt_recovers_an_amdahl_serial_fraction():
    serial = 0.1
    times = {n: 100.0 * (serial + (1 - serial) / n) for n in (1, 2, 4, 8)}
    points = _points(times)
    assert [p.serial_fraction for p in points[1:]] == pytest.approx([serial] * 3, rel=1e-12)
    assert "serial fraction ≈ 10.0%" in points[-1].causes[0]
    assert karp_flatt(1.0, 1) is None


def test_causes_name_communication_imbalance_and_oversubscription():
    samples = {
        1: [Sample(10.0, 0.0, (10.0,))],
        2: [Sample(8.0, 4.0, (4.0, 4.1))],  # half of the time communicating
        4: [Sample(5.0, 0.5, (1.0, 1.0, 1.0, 4.0))],  # one slow rank
    }
    points = analyse("strong", samples, cores=2)
    assert points[1].comm_fraction == 0.5 and points[1].rating == "acceptable"
    assert points[1].causes == ("communication-bound: 50% of the wall time is communication/waiting",)
    assert points[2].imbalance == pytest.approx(4.0 / 1.75 - 1)
    assert points[2].causes[0] == "oversubscribed: 4 ranks share 2 cores"
    assert "load imbalance: slowest rank 129% above the mean" in points[2].causes


def test_a_multi_threaded_baseline_is_named_instead_of_a_serial_fraction():
    """pi montecarlo 1e10 on one rank kept both cores busy: its 'serial fraction' of 77 % was the
    baseline's own threads, not a serial part of the program."""
    samples = {1: [Sample(10.0)], 2: [Sample(8.6)]}
    plain = analyse("strong", samples, cores=2)[1].causes
    assert plain == ("fixed overhead: serial fraction ≈ 72.0% (Karp–Flatt)",)  # (1/S − 1/2)/(1 − 1/2)
    threaded = analyse("strong", samples, cores=2, baseline_cores=1.9)[1].causes
    assert threaded[0].startswith("multi-threaded baseline: the 1-rank run kept 1.9 cores busy")
    assert not any("serial fraction" in cause for cause in threaded)
    # a baseline of 2 ranks is a parallel run by definition: no such note
    assert not any("multi-threaded" in c for c in analyse("strong", {2: samples[1], 4: samples[2]},
                                                          baseline_cores=1.9)[1].causes)  # fmt: skip


def test_cores_busy_measures_child_processes():
    import subprocess

    from meshwise.scale.runner import cores_busy

    done, busy = cores_busy(lambda: subprocess.run([sys.executable, "-c", "import time; time.sleep(0.5)"]))
    assert done.returncode == 0 and 0 <= busy < 0.9  # a sleeping child keeps no core busy


def test_invalid_measurements_are_refused():
    with pytest.raises(ValueError, match="positive"):
        speedup_efficiency("strong", 1, 1.0, 2, 0.0)
    with pytest.raises(ValueError, match="mode"):
        speedup_efficiency("diagonal", 1, 1.0, 2, 1.0)
    with pytest.raises(ValueError, match="no runs"):
        analyse("strong", {1: []})


SEEDS_OUTPUT = """\
rank 0/4 | local_rank 0/4 | GPU 0 | samples = 2500000000000 | hits = 1963494366269 | time = 11.409889 s
rank 1/4 | local_rank 1/4 | GPU 1 | samples = 2500000000000 | hits = 1963495905770 | time = 11.409886 s
rank 2/4 | local_rank 2/4 | GPU 2 | samples = 2500000000000 | hits = 1963494807727 | time = 11.409889 s
rank 3/4 | local_rank 3/4 | GPU 3 | samples = 2500000000000 | hits = 1963495651902 | time = 11.409895 s

===== FINAL RESULTS =====
Exact PI      = 3.14159265
Wall time     = 11.409895 s
"""


def test_parser_reads_the_seeds_output():
    sample = parse_output(SEEDS_OUTPUT)
    assert sample.wall_seconds == 11.409895
    assert sample.rank_seconds == (11.409889, 11.409886, 11.409889, 11.409895)
    assert sample.comm_seconds is None
    assert parse_output("Wall time = 3 s\nComm time = 250 ms\nWall time = 2.5e-1 s").wall_seconds == 0.25
    assert parse_output("Comm time = 250 ms\nWall time = 1 s").comm_seconds == 0.25
    assert parse_output("Total time = 28.578 ms") is None
    prefixed = parse_output("[rank 0] rank 0/1 | device cpu | time = 1.5 s\n[rank 0] Wall time      = 2.0 s")
    assert (prefixed.wall_seconds, prefixed.rank_seconds) == (2.0, (1.5,))


TOY = """\
import sys
ranks = int(sys.argv[1])
work = int(sys.argv[2]) if len(sys.argv) > 2 else 0
times = {1: 45.212765, 2: 22.608870, 4: 11.409895}
print("warming up")
print(f"Wall time = {times[ranks] if not work else 2.0 + 0.001 * work / ranks * (1 + (ranks > 2))} s")
"""


@pytest.fixture
def toy(tmp_path):
    path = tmp_path / "toy.py"
    path.write_text(TOY)
    return str(path)


def test_scale_on_a_toy_command_with_known_times(toy, tmp_path, capsys):
    out_json = tmp_path / "study.json"
    argv = [
        "scale",
        "--np",
        "4,1,2",
        "--repeat",
        "2",
        "--json",
        str(out_json),
        "--",
        sys.executable,
        toy,
        "{np}",
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "Cores:" in text
    record = json.loads(out_json.read_text())
    assert record["time_source"] == "reported" and record["mode"] == "strong"
    assert [p["ranks"] for p in record["points"]] == [1, 2, 4]
    assert [p["times"] for p in record["points"]] == [[45.212765] * 2, [22.60887] * 2, [11.409895] * 2]
    assert [round(p["speedup"], 4) for p in record["points"]] == [1.0, 1.9998, 3.9626]
    assert [round(p["efficiency"], 4) for p in record["points"]] == [1.0, 0.9999, 0.9906]
    assert all(p["model_seconds"] is None for p in record["points"])  # no payload given, no model line


def test_weak_scaling_of_a_toy_command_substitutes_work(toy, tmp_path, capsys):
    out_json = tmp_path / "weak.json"
    argv = ["scale", "--mode", "weak", "--np", "1,2,4", "--repeat", "1", "--work", "1000", "--json",
            str(out_json), "--", sys.executable, toy, "{np}", "{work}"]  # fmt: skip
    assert main(argv) == 0
    points = json.loads(out_json.read_text())["points"]
    # T(n) = 2 + work_total/n/1000·(2 if n > 2): 3, 3, 4 s → weak efficiency 1, 1, 0.75
    assert [p["wall_seconds"] for p in points] == pytest.approx([3.0, 3.0, 4.0])
    assert [p["efficiency"] for p in points] == pytest.approx([1.0, 1.0, 0.75])
    assert points[2]["rating"] == "acceptable"
    assert "Weak efficiency" in capsys.readouterr().out


def test_command_without_a_wall_time_line_is_timed_around_the_process(tmp_path, capsys):
    argv = ["scale", "--np", "1", "--repeat", "1", "--", sys.executable, "-c", "import sys; sys.argv", "{np}"]
    assert main(argv) == 0
    assert "times include process start-up" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--", sys.executable, "-c", "pass"], "must contain {np}"),
        (["--", "no-such-binary-xyz", "{np}"], "neither a workload"),
        (["pi-montecarlo", "--np", "0,2"], "distinct positive"),
        (["pi-montecarlo", "--np", "1,1"], "distinct positive"),
        (["pi-montecarlo", "--repeat", "0"], "at least 1"),
        (["pi-montecarlo", "--work", "0"], "positive"),
        (["pi-midpoint", "extra"], "takes no extra arguments"),
        (["train:"], "needs a model name"),
        (["train:resnet9000", "-np", "1,2"], "`meshwise train` has no model 'resnet9000'; use train:<model>"),
        (["pi-midpoint", "--backend", "carrier-pigeon"], "is unknown"),
        (["pi-midpoint", "--mode", "weak", "--work", "4e15", "--np", "1,4"], "exceeds the supported maximum"),
        (["--mode", "weak", "--", sys.executable, "-c", "pass", "{np}"], "put {work} in the command"),
    ],
)
def test_bad_studies_are_refused_before_running(argv, message, capsys):
    assert main(["scale", *argv]) == 2
    assert message in capsys.readouterr().err


def test_failing_command_names_its_exit_code(capsys):
    argv = ["scale", "--np", "1", "--repeat", "1", "--", sys.executable, "-c", "raise SystemExit(3)", "{np}"]
    assert main(argv) == 1
    assert "exited with 3" in capsys.readouterr().err


def test_train_workload_builds_the_train_command():
    workload = parse_workload(["train:mlp", "--steps", "5"])
    assert workload.argv == (sys.executable, "-m", "meshwise", "train", "mlp", "-np", "{np}", "--steps", "5")


def test_cost_model_line_follows_the_contract(monkeypatch):
    import meshwise.scale.model as model

    link = types.SimpleNamespace(alpha=1e-3, beta=0.0, gamma=0.0)

    class Calibration:
        intra = link

        def for_world(self, world_size):
            return self

    monkeypatch.setattr(model, "choose_algorithm", lambda collective, nbytes, world, calibration: "ring")
    monkeypatch.setattr(
        model, "predict_seconds", lambda collective, algo, nbytes, world, lk: 2 * (world - 1) * lk.alpha
    )
    points = analyse("strong", {1: [Sample(8.0, 0.0)], 2: [Sample(4.5, 0.5)], 4: [Sample(2.5, 0.5)]})
    cal = Calibration()
    assert predicted_times("strong", points, 8, cal) == pytest.approx([8.0, 4.0 + 0.002, 2.0 + 0.006])
    assert predicted_times("weak", points, 8, cal) == pytest.approx([8.0, 8.002, 8.006])


def test_cost_model_line_prices_each_scale_with_its_own_calibration(tmp_path):
    from meshwise.comm.algorithms.registry import predict_seconds
    from meshwise.comm.cost import Calibration, LinkParams, WorldLinks

    quick, slow = LinkParams(1e-5, 1e-9, 1e-10), LinkParams(5e-3, 1e-9, 1e-10)
    quicker = LinkParams(1e-6, 1e-10, 1e-11)  # a native collective no algorithm of ours can beat
    cal = Calibration(quick, quick, quick).with_world(2, WorldLinks(quick, quicker))
    path = cal.with_world(4, WorldLinks(slow, slow)).save(tmp_path / "cal.json")
    points = analyse("weak", {2: [Sample(1.0, None)], 4: [Sample(1.0, None)]})
    times = predicted_times("weak", points, 4096, Calibration.load(path))
    # 4 ranks, slow entry: rd (2 steps) beats the native ring (6 steps) by the margin; 2 ranks keep native
    expected = predict_seconds("all_reduce", "rd", 4096, 4, slow)
    expected -= predict_seconds("all_reduce", "native", 4096, 2, quicker)
    assert times[1] - times[0] == pytest.approx(expected)


def test_plot_writes_an_image(tmp_path):
    pytest.importorskip("matplotlib")
    for mode in ("strong", "weak"):
        path = tmp_path / f"{mode}.png"
        points = _points(SEEDS_EXERCISE_4, mode=mode)
        plot(str(path), mode, points, [p.wall_seconds * 1.01 for p in points], "seeds")
        assert path.read_bytes()[:4] == b"\x89PNG"


def test_pi_study_on_spawned_ranks(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out_json, out_png = tmp_path / "pi.json", tmp_path / "pi.png"
    argv = ["scale", "pi-montecarlo", "-np", "1,2", "--repeat", "2", "--work", "200000", "--json",
            str(out_json), "--plot", str(out_png)]  # fmt: skip  (-np as in every other command)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "n=1: running 2 runs" in out and "n=2: running 2 runs" in out  # progress before each scale
    assert f"JSON written to {out_json}" in out and f"plot written to {out_png}" in out
    record = json.loads(out_json.read_text())
    assert record["work"] == 200_000 and len(record["points"]) == 2
    for point in record["points"]:
        assert len(point["times"]) == 2 and all(t > 0 for t in point["times"])
        assert 0 <= point["comm_fraction"] < 1
        assert math.isfinite(point["efficiency"])
    assert record["points"][1]["imbalance"] is not None
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_point_record_is_plain_data():
    point = _points({1: 1.0})[0]
    assert isinstance(point, ScalePoint) and point.causes == ()
