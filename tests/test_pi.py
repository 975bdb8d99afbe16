"""π workloads: work split, counter-based RNG, kernels against pure-Python references, rank-count
invariance on spawned gloo ranks, the seeds' figures, and input errors."""

import math
import re

import pytest
import torch

from conftest import joined
from meshwise.cli import main
from meshwise.cli.pi import parse_count
from meshwise.runtime.spawn import spawn
from meshwise.scale.runner import WALL_TIME_LINE, parse_output
from meshwise.workloads.counter_rng import MASK64, random_bits, random_bits_reference, stream_key
from meshwise.workloads.pi import (
    check_work,
    estimate_from_hits,
    midpoint_partial,
    montecarlo_hits,
    split_range,
)
from meshwise.workloads.pi_fused import midpoint_partial_fused, montecarlo_hits_fused
from meshwise.workloads.pi_job import resolve_kernel, run_pi


@pytest.mark.parametrize(("n", "parts"), [(10, 3), (10_000, 4), (7, 7), (3, 5), (100_003, 4)])
def test_split_tiles_the_range_with_the_first_ranks_taking_the_remainder(n, parts):
    ranges = [split_range(n, parts, r) for r in range(parts)]
    position = 0
    for start, count in ranges:
        assert start == position
        position += count
    assert position == n
    counts = [c for _, c in ranges]
    extra = n % parts
    assert counts == [n // parts + 1] * extra + [n // parts] * (parts - extra)


def test_split_rejects_missing_parts():
    with pytest.raises(ValueError, match="part 4 of 4"):
        split_range(10, 4, 4)


def test_torch_stream_matches_the_python_reference_bit_for_bit():
    key = stream_key(123)
    for first in (0, 12_345, 10**13 - 3, 2**52):
        values = random_bits(key, first, 7).tolist()
        assert [v & MASK64 for v in values] == [random_bits_reference(key, first + i) for i in range(7)]


def test_nearby_seeds_give_unrelated_streams_and_negative_seeds_are_refused():
    a, b = random_bits(stream_key(0), 0, 64), random_bits(stream_key(1), 0, 64)
    assert not torch.equal(a, b)
    with pytest.raises(ValueError, match="non-negative"):
        stream_key(-1)


def _reference_hits(start, count, seed):
    """The hit rule written out in plain integers: 30-bit cell centres inside the quarter circle."""
    key, hits = stream_key(seed), 0
    for i in range(start, start + count):
        bits = random_bits_reference(key, i)
        x, y = bits >> 34, bits & ((1 << 30) - 1)
        hits += (2 * x + 1) ** 2 + (2 * y + 1) ** 2 < 1 << 62
    return hits


@pytest.mark.parametrize("start", [0, 10**13 - 1500])  # a range at the end of a 1e13 job: no N-sized buffer
def test_montecarlo_kernel_matches_reference_for_any_chunking(start):
    expected = _reference_hits(start, 1500, seed=9)
    for chunk in (1, 97, 1024, None):
        assert montecarlo_hits(start, 1500, 9, chunk=chunk) == expected


def test_memory_is_bounded_by_the_chunk_not_by_n(monkeypatch):
    import meshwise.workloads.pi as pi_module

    sizes = []

    def recording_bits(key, first, count, device="cpu"):
        sizes.append(count)
        return random_bits(key, first, count, device)

    monkeypatch.setattr(pi_module, "random_bits", recording_bits)
    montecarlo_hits(10**13, 10_000, 1, chunk=512)  # a slice of a 1e13-sample job
    assert max(sizes) == 512 and sum(sizes) == 10_000


def test_midpoint_kernel_matches_the_formula_and_is_chunk_independent():
    n = 1000
    expected = math.fsum(4.0 / (1.0 + ((i + 0.5) / n) ** 2) / n for i in range(100, 400))
    for chunk in (7, 64, None):
        assert midpoint_partial(100, 300, n, chunk=chunk) == pytest.approx(expected, rel=1e-14)
    tail = midpoint_partial(10**13 - 10, 10, 10**13)  # last bins of a 1e13 grid: f(1) = 2, h = 1e-13
    assert tail == pytest.approx(10 * 2.0e-13, rel=1e-9)


def _fused_job(samples, chunk):
    """The report and what rank 0 said on stderr (captured here: a spawned rank's stderr is not the
    test's once a forkserver exists)."""
    import contextlib
    import io

    said = io.StringIO()
    with joined("gloo", timeout=30) as world, contextlib.redirect_stderr(said):
        report = run_pi(world, "montecarlo", samples, seed=5, chunk=chunk, kernel="fused", progress=True)
    return report, said.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(240)  # a cold inductor cache compiles two C++ kernels (~20-40 s on 2 busy cores)
def test_fused_kernels_match_the_eager_ones():
    """The compiled loop (C++ here, Triton on CUDA) gives the same hits and sums; the last chunk is masked."""
    start, count = 10**13 - 10_000, 10_000 + 4_321  # crosses 1e13, not a multiple of the chunk
    assert montecarlo_hits_fused(start, count, 9, chunk=4096) == montecarlo_hits(start, count, 9)
    assert montecarlo_hits_fused(0, 5, 9, chunk=4096) == _reference_hits(0, 5, 9)
    expected = midpoint_partial(3, 10_000, 10**6)
    assert midpoint_partial_fused(3, 10_000, 10**6, chunk=4096) == pytest.approx(expected, rel=1e-13)
    # the job path on a spawned rank: compiled before the barrier (the kernel is cached by now), and
    # rank 0 says so instead of going silent for the ~30 s a cold compile takes
    report, err = spawn(_fused_job, 1, (20_001, 4096), timeout=120)[0]
    assert report.total_hits == montecarlo_hits(0, 20_001, 5)
    assert "meshwise pi: preparing the fused kernel" in err and "meshwise pi: kernel ready in" in err


def test_auto_kernel_compiles_only_for_large_shares():
    assert resolve_kernel("auto", 10_000) == "eager"
    assert resolve_kernel("auto", 10**9) == "fused"
    assert resolve_kernel("eager", 10**12) == "eager"
    with pytest.raises(ValueError, match="unknown kernel"):
        resolve_kernel("triton", 1)


def test_montecarlo_is_statistically_sound():
    n = 1_000_000
    estimate, stderr = estimate_from_hits(montecarlo_hits(0, n, 2024), n)
    assert stderr == pytest.approx(4 * math.sqrt(math.pi / 4 * (1 - math.pi / 4) / n), rel=1e-2)
    assert abs(estimate - math.pi) < 4 * stderr


def test_standard_error_on_the_seeds_run():
    estimate, stderr = estimate_from_hits(7_853_980_731_668, 10_000_000_000_000)  # seeds' exercise 2
    assert f"{estimate:.8f}" == "3.14159229"
    assert stderr == pytest.approx(5.19e-7, rel=1e-2)


def _both_methods(mc_samples):
    with joined("gloo", timeout=30) as world:
        reports = (run_pi(world, "midpoint", 10_000), run_pi(world, "montecarlo", mc_samples, seed=123))
    return reports


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_ranks_agree_with_one_process(ranks):
    samples = 100_003  # not divisible by 2, 3 or 4
    reports = spawn(_both_methods, ranks, (samples,), timeout=90)
    assert all(r == reports[0] for r in reports)  # every rank holds the same combined result
    midpoint, monte_carlo = reports[0]
    assert abs(midpoint.estimate - math.pi) < 1e-9
    assert midpoint.abs_error == pytest.approx(8.33333846e-10, abs=1e-14)  # seeds' exercise 1 figure
    assert monte_carlo.total_hits == montecarlo_hits(0, samples, 123)  # identical for any rank count
    assert [r.items for r in monte_carlo.ranks] == [split_range(samples, ranks, r)[1] for r in range(ranks)]
    assert sum(r.hits for r in monte_carlo.ranks) == monte_carlo.total_hits
    assert monte_carlo.wall_seconds == max(r.total_seconds for r in monte_carlo.ranks)


def test_report_has_the_seeds_layout_and_feeds_the_scale_parser():
    world_reports = spawn(_both_methods, 2, (1000,), timeout=60)[0]
    midpoint, monte_carlo = world_reports
    text = monte_carlo.format()
    lines = text.splitlines()
    rank_line = (
        r"rank {r}/2 \| local_rank {r}/2 \| device cpu \| samples = \d+ \| hits = \d+ \| time = [\d.]+ s"
    )
    assert re.fullmatch(rank_line.format(r=0), lines[0]) and re.fullmatch(rank_line.format(r=1), lines[1])
    assert "===== FINAL RESULTS =====" in lines
    for label in (
        "Exact PI",
        "Estimated PI",
        "Absolute error",
        "Relative error",
        "Total hits",
        "Total samples",
    ):
        assert any(line.startswith(label) for line in lines), label
    assert f"Total hits     = {monte_carlo.total_hits}" in lines
    parsed = parse_output(text)
    assert parsed.wall_seconds == pytest.approx(monte_carlo.wall_seconds, abs=1e-6)
    assert len(parsed.rank_seconds) == 2
    assert (
        "Computed PI    = 3.14159265" in midpoint.format() and "Total bins     = 10000" in midpoint.format()
    )
    assert WALL_TIME_LINE.search(midpoint.format())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0", "positive"),
        ("-5", "positive"),
        ("1.5", "whole number"),
        ("ten", "not a number"),
        ("1e17", "2\\*\\*53"),
    ],
)
def test_bad_sample_counts_are_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_count(text)


def test_counts_parse_exactly():
    assert parse_count("1e13") == 10**13
    assert parse_count("10_000") == 10_000
    with pytest.raises(TypeError):
        check_work(1.0)


def test_cli_refuses_bad_input_before_launching(capsys):
    assert main(["pi", "midpoint", "0", "-np", "4"]) == 2
    assert "N must be a positive number" in capsys.readouterr().err
    assert main(["pi", "montecarlo", "100", "-np", "0"]) == 2
    assert "-np must be at least 1" in capsys.readouterr().err
    assert main(["pi", "montecarlo", "100", "--backend", "carrier-pigeon"]) == 2
    assert "--backend 'carrier-pigeon' is unknown" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["pi", "montecarlo", "100", "--device", "cuda"]) == 2
        assert "CUDA is not available" in capsys.readouterr().err


def test_seed_is_taken_positionally_as_the_lecture_passes_it(capsys):
    """`mpi_cuda_pi_mc.x N 123` carries over as `meshwise pi montecarlo N 123`."""
    assert main(["pi", "montecarlo", "3001", "7"]) == 0
    assert f"Total hits     = {montecarlo_hits(0, 3001, 7)}" in capsys.readouterr().out
    assert main(["pi", "montecarlo", "3001", "7", "--seed", "8"]) == 2
    assert "SEED 7 and --seed 8 disagree" in capsys.readouterr().err
    assert main(["pi", "midpoint", "3001", "7"]) == 2
    assert "midpoint takes no SEED" in capsys.readouterr().err


def test_heartbeat_speaks_during_long_work_and_not_after():
    import io
    import time as clock

    from meshwise.runtime.heartbeat import heartbeat

    sink = io.StringIO()
    with heartbeat("meshwise pi: computing", every=0.05, stream=sink):
        clock.sleep(0.3)
    beats = sink.getvalue().splitlines()
    assert len(beats) >= 2 and all(b.startswith("meshwise pi: computing: ") for b in beats)
    clock.sleep(0.15)
    assert sink.getvalue().splitlines() == beats  # stopped with the block
    quiet = io.StringIO()
    with heartbeat("x", every=0.01, stream=quiet, enabled=False):
        clock.sleep(0.05)
    assert quiet.getvalue() == ""


def test_cli_spawns_ranks_and_prints_the_final_block(capsys):
    assert main(["pi", "montecarlo", "5001", "-np", "2", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert f"Total hits     = {montecarlo_hits(0, 5001, 3)}" in out
    assert "Total samples  = 5001" in out and len(re.findall(r"^rank \d/2 ", out, re.MULTILINE)) == 2
    assert WALL_TIME_LINE.search(out)
