"""meshwise bench: sizes, nccl-tests definitions, checks that can fail, JSON, plots, calibration."""

import json
import subprocess
import sys

import pytest
import torch

import meshwise
from meshwise.bench import cases
from meshwise.bench.busbw import COLLECTIVES, algbw, bus_factor, busbw, layout_for
from meshwise.bench.calibrate import merge_fit
from meshwise.bench.cases import Case, pattern
from meshwise.bench.jsonio import from_dict, read_json, to_dict
from meshwise.bench.plot import plot_runs
from meshwise.bench.runner import Figures, Row, RunResult, SweepConfig, run_sweep
from meshwise.bench.sizes import format_size, parse_size, size_sweep
from meshwise.cli import build_parser, main
from meshwise.cli.bench import build_job
from meshwise.comm.algorithms.registry import predict_seconds
from meshwise.comm.api import Communicator, CompletedWork, ReduceOp
from meshwise.comm.cost import Calibration, LinkParams, WorldLinks
from meshwise.runtime.spawn import spawn

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _assert_png(path, min_pixels: int = 100_000) -> None:
    """A PNG that decodes (not just its signature) into a real picture."""
    from matplotlib.image import imread

    assert path.read_bytes().startswith(PNG_SIGNATURE)
    height, width, channels = imread(str(path)).shape
    assert height * width >= min_pixels and channels in (3, 4)


# ---------------------------------------------------------------------------------------------- sizes
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8", 8),
        ("4K", 4096),
        ("4k", 4096),
        ("4KiB", 4096),
        ("64M", 64 << 20),
        ("1G", 1 << 30),
        (" 2MB ", 2 << 20),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected
    assert parse_size(format_size(expected)) == expected


def test_fractional_sizes_are_read_as_nccl_tests_reads_them():
    """nccl-tests takes `-b 1.5K`; a fraction of a byte is dropped as its integer conversion does."""
    assert parse_size("1.5K") == 1536 and parse_size("0.5M") == 1 << 19 and parse_size(".25G") == 1 << 28
    assert parse_size("1.1K") == 1126 and parse_size("2.5") == 2
    assert parse_size("1.1T") == 11 * (1 << 40) // 10  # exact, no float rounding at terabytes


@pytest.mark.parametrize("text", ["1.5.K", "-4", "4X", "", "K", "."])
def test_parse_size_refuses_what_it_cannot_read(text):
    with pytest.raises(ValueError, match="write bytes like"):
        parse_size(text)


def test_size_sweeps():
    assert size_sweep(8, 64, factor=2) == [8, 16, 32, 64]
    assert size_sweep(4096, 64 << 20, factor=16) == [4096, 65536, 1 << 20, 16 << 20]
    assert size_sweep(100, 350, step=100) == [100, 200, 300]
    assert format_size(3 << 20) == "3M" and format_size(1000) == "1000"
    with pytest.raises(ValueError, match="swap -b and -e"):
        size_sweep(64, 8, factor=2)
    with pytest.raises(ValueError, match="exactly one"):
        size_sweep(8, 64, factor=2, step=8)
    with pytest.raises(ValueError, match="at least 2"):
        size_sweep(8, 64, factor=1)


# ---------------------------------------------------------------------------------------------- busbw
# nccl-tests doc/PERFORMANCE.md, written out for 4 and 8 ranks.
NCCL_FACTORS = {
    4: {"all_reduce": 1.5, "all_gather": 0.75, "reduce_scatter": 0.75, "all_to_all": 0.75, "gather": 0.75,
        "scatter": 0.75, "broadcast": 1.0, "reduce": 1.0, "sendrecv": 1.0},
    8: {"all_reduce": 1.75, "all_gather": 0.875, "reduce_scatter": 0.875, "all_to_all": 0.875,
        "gather": 0.875, "scatter": 0.875, "broadcast": 1.0, "reduce": 1.0, "sendrecv": 1.0},
}  # fmt: skip


@pytest.mark.parametrize("ranks", [4, 8])
def test_bus_factors_match_nccl_tests(ranks):
    assert set(NCCL_FACTORS[ranks]) == set(COLLECTIVES)
    for collective, factor in NCCL_FACTORS[ranks].items():
        assert bus_factor(collective, ranks) == factor, collective
        assert busbw(collective, 10**9, 1.0, ranks) == pytest.approx(factor)
    assert algbw(2 * 10**9, 0.5) == 4.0  # GB/s are 10^9 B/s
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("allreduce", 4)


def test_layout_is_nccl_tests_size_and_count():
    # all_reduce: S = the buffer, count = its elements; the size is rounded down to whole elements.
    lay = layout_for("all_reduce", 1002, 4, 4)
    assert (lay.count, lay.nbytes) == (250, 1000)
    # slotted collectives: count = one slot of whole 16-byte blocks (nccl-tests), S = all n slots.
    for collective in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        lay = layout_for(collective, 1000, 4, 4)
        assert (lay.count, lay.total_elements, lay.nbytes) == (60, 240, 960), collective
    assert layout_for("all_gather", 8, 4, 4).count == 0  # too small: a count-0 row, as nccl-tests prints


def test_slots_round_down_to_16_bytes_as_nccl_tests():
    """3 ranks of float32 asked for 64/256/1K/4K B: nccl-tests' all_gather_perf prints 48/240/1008/4080."""
    got = [layout_for("all_gather", s, 3, 4) for s in (64, 256, 1024, 4096)]
    assert [lay.nbytes for lay in got] == [48, 240, 1008, 4080]
    assert [lay.count for lay in got] == [4, 20, 84, 340]
    assert layout_for("reduce_scatter", 1024, 3, 8).count == 42  # float64: blocks of 2 elements
    assert layout_for("all_to_all", 1024, 3, 2).count == 168  # float16: blocks of 8 elements
    assert layout_for("all_reduce", 1022, 3, 4).count == 255  # unslotted: whole elements only


# ---------------------------------------------------------------------------------------------- options
def _args(*argv):
    return build_parser("bench").parse_args(["bench", *argv])


def test_options_are_parsed_into_a_job():
    argv = (
        "all -np 3 -b 1K -e 16K -f 4 -n 7 -w 2 -c 3 --dtype bfloat16 --op max --root 2 --algo ring,rhd,ring"
    )
    job, world, launcher = build_job(_args(*argv.split()))
    assert (world, launcher) == (3, "local")
    assert job.collectives == COLLECTIVES and job.backends == ("gloo",) and job.algorithms == ("ring", "rhd")
    sweep = job.sweep
    assert sweep.sizes == (1024, 4096, 16384)
    assert (sweep.iters, sweep.warmup, sweep.checks, sweep.dtype, sweep.op, sweep.root) == (
        7, 2, 3, "bfloat16", "max", 2
    )  # fmt: skip
    assert build_job(_args("sendrecv", "-i", "1K", "-b", "1K", "-e", "3K"))[0].sweep.sizes == (
        1024,
        2048,
        3072,
    )


def test_nccl_tests_spellings_are_accepted():
    """An all_reduce_perf command line carries over: -o/-d/-r, nccl-tests' type names, -r -1 for every
    root, -f 1 with -i stepping (and -f 1 alone stepping by nccl-tests' default 1M), -b 1.5K."""
    argv = "reduce -np 3 -o max -d float -r 2 -b 1.5K -e 3K -f 1 -i 768"
    sweep = build_job(_args(*argv.split()))[0].sweep
    assert (sweep.op, sweep.dtype, sweep.root, sweep.sizes) == ("max", "float32", 2, (1536, 2304, 3072))
    assert build_job(_args("all_reduce", "-d", "half"))[0].sweep.dtype == "float16"
    assert build_job(_args("all_reduce", "-d", "double"))[0].sweep.dtype == "float64"
    assert build_job(_args("broadcast", "-np", "3", "-r", "-1"))[0].sweep.root == -1
    assert build_job(_args("all_reduce", "-b", "1M", "-e", "3M", "-f", "1"))[0].sweep.sizes == (
        1 << 20, 2 << 20, 3 << 20
    )  # fmt: skip


def _docs_flag_table() -> dict[str, str]:
    """docs/bench.md's "flag / nccl-tests / meshwise" table: flag → meshwise column."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "bench.md").read_text()
    table = text.split("| flag | nccl-tests | meshwise |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[2:]:
        flags, _, mine = (cell.strip() for cell in line.strip("|").split("|"))
        for flag in flags.replace("`", "").split(","):
            rows[flag.strip()] = mine
    return rows


#: One nccl-tests spelling per shared flag, and what the job must hold after parsing it.
_NCCL_TESTS_FLAGS = {
    "-b": ("1.5K", lambda job: job.sweep.sizes[0] == 1536),
    "-e": ("4K", lambda job: job.sweep.sizes[-1] == 4096),
    "-i": ("1K", lambda job: job.sweep.sizes[:2] == (8, 1032)),
    "-f": ("4", lambda job: job.sweep.sizes[:2] == (8, 32)),
    "-n": ("3", lambda job: job.sweep.iters == 3),
    "-w": ("2", lambda job: job.sweep.warmup == 2),
    "-c": ("2", lambda job: job.sweep.checks == 2),
    "-d": ("half", lambda job: job.sweep.dtype == "float16"),
    "-o": ("max", lambda job: job.sweep.op == "max"),
    "-r": ("-1", lambda job: job.sweep.root == -1),
    "-a": ("3", lambda job: job.sweep.average == 3),
}


def test_docs_flag_table_matches_the_parser(capsys):
    """Every flag the table says meshwise shares is parsed with nccl-tests' meaning; every flag it says
    is not offered is refused."""
    rows = _docs_flag_table()
    shared = {flag for flag, mine in rows.items() if mine.startswith("same") or mine.startswith("the same")}
    assert shared == set(_NCCL_TESTS_FLAGS)
    for flag, (value, holds) in _NCCL_TESTS_FLAGS.items():
        assert holds(build_job(_args("reduce", "-np", "3", flag, value))[0]), flag
    for flag in (flag for flag, mine in rows.items() if mine == "not offered" or mine.startswith("`-np")):
        with pytest.raises(SystemExit):
            _args("all_reduce", flag, "1")
    capsys.readouterr()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("all_reduce", "-e", "64Q"), "write bytes like"),
        (("all_reduce", "--op", "avg", "--dtype", "int32"), "not defined for int32"),
        (("broadcast", "--root", "2"), "outside 0..1"),
        (("all_reduce", "--backend", "gloo,tcp"), "--backend 'tcp' is unknown"),
        (("all_reduce", "--algo", "ring,butterfly"), "unknown algorithm"),
        (("all_reduce", "--backend", "mpi"), "mpirun"),
        (("all_reduce", "-f", "4", "-i", "1K"), "give -f 1 or leave -f out"),
        (("broadcast", "--algo", "native,ring"), "ring does not implement broadcast; choose from native"),
        (("broadcast", "-r", "-2"), "or -1 for every root"),
        (("all_reduce", "-n", "0"), "-n must be at least 1"),
        (("all_reduce", "--ceiling", "0"), "--ceiling must be"),
        (("sendrecv", "-np", "1"), "at least 2 ranks"),
        ((), "name a COLLECTIVE"),
    ],
)
def test_bad_options_are_refused_before_launch(argv, message):
    with pytest.raises(ValueError, match=message):
        build_job(_args(*argv))


def test_calibration_files_are_checked_before_launch(tmp_path):
    with pytest.raises(ValueError, match="does not exist; write it with --calibrate"):
        build_job(_args("all_reduce", "--algo", "auto", "--calibration-file", str(tmp_path / "none.json")))
    assert build_job(_args("--calibrate", "--calibration-file", str(tmp_path / "new.json")))[0].calibrate
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="malformed"):
        build_job(_args("all_reduce", "--algo", "auto", "--calibration-file", str(bad)))


def _shared_calibration(paths):
    from meshwise.bench.job import shared_calibration

    world = meshwise.init("gloo", timeout=30)
    calibration = shared_calibration(world.comm, paths[world.rank])
    meshwise.shutdown()
    return calibration


def test_auto_prices_with_rank_zeros_calibration_on_every_rank(tmp_path):
    """auto must choose identically everywhere, even when ranks' nodes hold different files."""
    mine = Calibration(
        LinkParams(1e-5, 2e-9, 3e-10), LinkParams(4e-5, 5e-9, 6e-10), LinkParams(7e-5, 8e-9, 0.0)
    )
    mine.save(tmp_path / "cal.json")
    results = spawn(_shared_calibration, 2, ([str(tmp_path / "cal.json"), str(tmp_path / "absent.json")],))
    assert results == [mine, mine]


def test_nccl_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="needs CUDA"):
        build_job(_args("all_reduce", "--backend", "nccl"))


def test_bad_option_exit_code_is_2(capsys):
    assert main(["bench", "all_reduce", "--op", "avg", "--dtype", "int64"]) == 2
    assert "use --op sum" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- checks
class _Overrun(Communicator):
    """One rank whose all_reduce also writes one element past the end of its buffer."""

    backend = "overrun"

    def __init__(self):
        super().__init__(0, 1, 10.0)

    def _all_reduce(self, tensor, op):
        torch.as_strided(tensor, (tensor.numel() + 1,), (1,), tensor.storage_offset()).fill_(7)
        return CompletedWork()

    def _isend(self, *a):
        return CompletedWork()

    _irecv = _broadcast = _reduce = _all_gather = _reduce_scatter = _all_to_all = _isend
    _scatter = _gather = _barrier = _split = _isend


class _Honest(_Overrun):
    def _all_reduce(self, tensor, op):
        return CompletedWork()  # one rank: the input is the result


def test_guards_catch_out_of_bounds_writes_and_values_are_checked():
    layout = layout_for("all_reduce", 64, 1, 4)
    case = Case(_Overrun(), layout, torch.float32, ReduceOp.SUM, 0, torch.device("cpu"))
    case.prepare(salt=1)
    case.run()
    # it wrote 7 everywhere; a one-rank all_reduce must return the input, whose values lie in -4..4
    assert case.check(1) == (layout.count, 1)
    case.prepare(salt=2)
    case.comm = _Honest()
    case.run()
    assert case.check(2) == (0, 0)


class _FakeGather(_Overrun):
    """Rank 1 of 3 whose all_gather fills the other slots with those ranks' check inputs."""

    def __init__(self, salt):
        Communicator.__init__(self, 1, 3, 10.0)
        self.salt = salt

    def _all_gather(self, outputs, input):
        for k, out in enumerate(outputs):
            source = input if k == self.rank else pattern(k, 0, out.numel(), out.dtype, ReduceOp.SUM, 3, 1)
            out.copy_(source)
        return CompletedWork()


def test_chunked_reference_follows_slots(monkeypatch):
    monkeypatch.setattr(cases, "CHUNK_ELEMENTS", 7)  # 20-element slots in chunks of 7, 7 and 6
    layout = layout_for("all_gather", 3 * 20 * 4, 3, 4)
    case = Case(_FakeGather(1), layout, torch.float32, ReduceOp.SUM, 0, torch.device("cpu"))
    case.prepare(salt=1)
    case.run()
    assert case.check(1) == (0, 0)
    case.result[2 * 20 + 13] += 1  # slot 2, third chunk
    assert case.check(1) == (1, 0)


def _sweep_matrix():
    """Every collective, several dtypes, ops and roots, native and algorithm communicators."""
    from meshwise.comm.algorithms import with_algorithm

    world = meshwise.init("gloo", timeout=30)
    out = []
    configs = [
        SweepConfig(c, (8, 100, 4096), dtype=dt, op=op, root=root, iters=1, warmup=0, checks=1)
        for c in COLLECTIVES
        for dt, op, root in (("float32", "sum", 0), ("bfloat16", "prod", 1), ("int32", "max", 1),
                             ("float16", "avg", 0), ("int64", "min", 0))
    ]  # fmt: skip
    for algo in ("native", "ring", "rhd", "tree"):
        comm = with_algorithm(world.comm, algo)
        for config in configs:
            rows = run_sweep(comm, world.comm, config, torch.device("cpu"))
            out.append(
                (algo, config.collective, config.dtype, config.op, [(r.wrong, r.out_of_bounds) for r in rows])
            )
    meshwise.shutdown()
    return out


def test_every_collective_dtype_op_and_root_checks_clean_on_three_ranks():
    results = spawn(_sweep_matrix, 3, timeout=100)
    assert results[0] == results[1] == results[2]  # verdicts are reduced over ranks
    for algo, collective, dtype, op, rows in results[0]:
        assert rows and all(r == (0, 0) for r in rows), (algo, collective, dtype, op, rows)


def _every_root_in_place_on_shm():
    from meshwise.comm.factory import create_communicator

    world = meshwise.init("gloo", timeout=30)
    shm = create_communicator("shm", timeout=30)
    out = []
    for collective in COLLECTIVES:
        config = SweepConfig(collective, (100, 4096), root=-1, iters=1, warmup=0, checks=1)
        rows = run_sweep(shm, world.comm, config, torch.device("cpu"))
        out.append((collective, [(r.root, r.size, r.out_of_place.wrong, r.in_place.wrong, r.out_of_bounds)
                                 for r in rows]))  # fmt: skip
    shm.close()
    meshwise.shutdown()
    return out


def test_in_place_and_every_root_on_shared_memory():
    """nccl-tests' in-place half (input aliasing the output) of every collective on the raw-pointer
    transport, and `-r -1`: every root in turn for the rooted ones, one pass with root -1 for the rest."""
    for collective, rows in spawn(_every_root_in_place_on_shm, 3, timeout=100)[0]:
        roots = [0, 0, 1, 1, 2, 2] if collective in ("broadcast", "reduce", "gather", "scatter") else [-1, -1]
        assert [r[0] for r in rows] == roots, collective
        assert all(r[2:] == (0, 0, 0) for r in rows), (collective, rows)


# ---------------------------------------------------------------------------------------------- end to end
def test_every_collective_on_two_ranks_reports_zero_wrong(tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = "bench all -np 2 -b 16 -e 1K -f 8 -n 2 -w 1 -c 1 --backend gloo --json"
    code = main([*argv.split(), str(path)])
    out = capsys.readouterr().out
    assert code == 0, out
    for column in ("size(B)", "count(elements)", "type", "redop", "root", "out-of-place", "in-place"):
        assert column in out
    for column in ("time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"):
        assert out.count(column) == 2 * len(COLLECTIVES)  # once per placement in every table
    assert "# Wrong elements       : 0 OK" in out and "Wall time = " in out
    assert "# calibration (prices auto): built-in" in out
    data = json.loads(path.read_text())
    assert [run["collective"] for run in data["runs"]] == list(COLLECTIVES)
    for run in data["runs"]:
        assert run["world_size"] == 2 and run["backend"] == "gloo" and run["algorithm"] == "native"
        # 16 B on 2 ranks leaves 8 B a slot, under one 16-byte block: a count-0 row, as nccl-tests
        slotted = run["collective"] in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")
        assert [row["size"] for row in run["rows"]] == [0 if slotted else 16, 128, 1024]
        for row in run["rows"]:
            for placement in (row["out_of_place"], row["in_place"]):
                assert placement["wrong"] == 0 and placement["out_of_bounds"] == 0
                assert placement["time_us"] > 0
        busbws = [row[p]["busbw"] for row in run["rows"] for p in ("out_of_place", "in_place")]
        assert run["avg_busbw"] == pytest.approx(sum(busbws) / 6)  # nccl-tests: both halves, every row
    assert data["world_size"] == 2 and data["launcher"] == "local" and data["versions"]["torch"]
    assert data["machine"]["cpu_count"] >= 1
    # the documented schema, key for key (docs/bench.md)
    assert data["schema"] == "meshwise.bench/2"
    assert " ".join(data["command"]) == (  # every effective option, so the record can be replayed
        "meshwise bench all -np 2 -b 16 -e 1K -f 8 -n 2 -w 1 --timing loop -a 1 -c 1 --dtype float32 "
        "--op sum --root 0 --backend gloo --algo native"
    )
    assert set(data) == {"schema", "created", "command", "launcher", "world_size", "timing", "machine",
                         "versions", "config", "runs"}  # fmt: skip
    assert set(data["machine"]) == {"hostname", "platform", "processor", "cpu_count", "gpus"}
    assert {"meshwise", "python", "torch", "numpy"} <= set(data["versions"])
    assert data["config"] == {
        "dtype": "float32",
        "op": "sum",
        "root": 0,
        "iters": 2,
        "warmup": 1,
        "checks": 1,
        "timing": "loop",
        "average": 1,
        "skew": 1,
        "calibration": "built-in",  # what auto would have priced with: no file is read unasked
    }
    assert set(data["runs"][0]) == {"collective", "backend", "algorithm", "world_size", "avg_busbw", "wrong",
                                    "out_of_bounds", "rows"}  # fmt: skip
    row = data["runs"][0]["rows"][0]
    assert set(row) == {"size", "count", "type", "redop", "root", "out_of_place", "in_place"}
    for placement in ("out_of_place", "in_place"):
        assert set(row[placement]) == {"time_us", "algbw", "busbw", "wrong", "out_of_bounds", "time_us_min",
                                       "time_us_max"}  # fmt: skip
    # JSON round trip: the record reads back into the same objects and writes the same document.
    record = read_json(str(path))
    assert to_dict(record) == data and to_dict(from_dict(to_dict(record))) == data
    with pytest.raises(ValueError, match="predates the out-of-place and in-place figures"):
        from_dict({**data, "schema": "meshwise.bench/1"})


def test_tables_written_to_a_file_have_no_trailing_spaces(tmp_path):
    """`meshwise bench … > log`: rich pads every line to the console width (160 off a terminal)."""
    done = subprocess.run(
        [sys.executable, "-m", "meshwise", "bench", "all_reduce", "-np", "1", "-b", "1K", "-e", "2K",
         "-n", "1", "-w", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any("busbw(GB/s)" in line for line in lines)
    assert [line for line in lines if line != line.rstrip()] == []


def test_under_a_launcher_it_runs_on_the_launched_ranks(tmp_path):
    """`meshwise run -np 2 -m meshwise bench …`: the two launched ranks are the job (no -np, nothing
    spawned), rank 0 reports, and every rank exits cleanly (a process group still referenced after
    shutdown used to abort a rank at exit now and then, failing a good run)."""
    path = tmp_path / "launched.json"
    argv = "-m meshwise run -np 2 -m meshwise bench all_reduce -b 1K -e 4K -n 1 -w 0 --backend gloo,shm"
    done = subprocess.run(
        [sys.executable, *argv.split(), "--algo", "native,auto", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(path.read_text())
    assert (data["launcher"], data["world_size"]) == ("torchrun", 2)
    runs = [(run["backend"], run["algorithm"], run["wrong"]) for run in data["runs"]]
    assert runs == [("gloo", "native", 0), ("gloo", "auto", 0), ("shm", "native", 0), ("shm", "auto", 0)]


def test_injected_wrong_result_fails_the_run(tmp_path, capsys):
    path = tmp_path / "bad.json"
    argv = "bench all_reduce -np 2 -b 1K -e 2K -n 1 -w 0 -c 2 --algo native,ring --inject-error 1 --json"
    code = main([*argv.split(), str(path)])
    captured = capsys.readouterr()
    assert code == 1
    assert "FAILED" in captured.out and "check FAILED for all_reduce" in captured.err
    runs = json.loads(path.read_text())["runs"]
    # one corrupted element per check (2) per size (2) on rank 1, for each algorithm and placement
    wrong = [[(r["out_of_place"]["wrong"], r["in_place"]["wrong"]) for r in run["rows"]] for run in runs]
    assert wrong == [[(2, 2), (2, 2)], [(2, 2), (2, 2)]]


def test_algorithms_side_by_side_and_plot(tmp_path, capsys):
    png = tmp_path / "bw.png"
    argv = "bench all_reduce -np 2 -b 4K -e 64K -f 4 -n 2 -w 1 --algo native,ring,rhd,auto --plot"
    code = main([*argv.split(), str(png)])
    out = capsys.readouterr().out
    assert code == 0, out
    for algo in ("native", "ring", "rhd", "auto"):
        assert f"all_reduce · backend gloo · algorithm {algo} · 2 ranks" in out
    _assert_png(png)


def test_rank_zero_draws_a_progress_bar_over_sizes_and_skips_are_noted(capsys, monkeypatch):
    """One rank in this process, stderr a terminal: the rich bar counts the sizes of every run; with
    `all`, an algorithm that does not implement a collective is skipped with one note, not reported."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    argv = "bench all -np 1 -b 1K -e 4K -n 1 -w 0 --algo rd,pairwise"
    code = main(argv.split())
    captured = capsys.readouterr()
    assert code == 0, captured.out
    for label in ("all_reduce gloo/rd", "all_gather gloo/rd", "all_to_all gloo/pairwise"):
        assert label in captured.err
    assert captured.err.count("3/3") >= 3
    assert "broadcast" not in captured.err and "algorithm pairwise · 1 rank" in captured.out
    text = " ".join(captured.out.split())  # the console wraps long notes
    note = text.split("# note: pairwise: skipped ", 1)[1].split("; it implements only all_to_all", 1)[0]
    assert set(note.split(", ")) == set(COLLECTIVES) - {"all_to_all", "sendrecv"}


def test_plot_with_model_ceiling_is_a_png(tmp_path):
    rows = tuple(
        Row(s, s // 4, "float32", "sum", -1, *[Figures(10 + s / 1e3, s / 1e4, s / 1e4, 0, 0, 9.0, 11.0)] * 2)
        for s in (0, 8, 64, 512)
    )  # a count-0 row has no place on the log axis and is left out
    runs = [RunResult("all_reduce", "gloo", algo, 4, rows) for algo in ("native", "ring")]
    runs.append(RunResult("sendrecv", "gloo", "native", 4, rows))
    calibration = Calibration(LinkParams(1e-5, 1e-9, 1e-10), LinkParams(2e-5, 2e-9, 1e-10))
    path = tmp_path / "model.png"
    plot_runs(runs, str(path), ceiling_gbps=12.5, calibration=calibration, title="t")
    _assert_png(path)


def test_calibrate_writes_the_cost_model_file_and_keeps_other_world_sizes(tmp_path, capsys):
    target = tmp_path / "calibration.json"
    four = WorldLinks(LinkParams(4e-3, 1e-9, 1e-10), LinkParams(5e-4, 1e-9, 1e-10))
    old_inter = LinkParams(9e-5, 9e-9, 9e-10)
    Calibration(four.intra, old_inter, four.native).with_world(4, four).save(target)  # from an -np 4 run
    argv = "bench --calibrate -np 2 -b 1K -e 256K -f 4 -n 3 -w 1 --calibration-file"
    code = main([*argv.split(), str(target)])
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long paths
    assert code == 0, out
    loaded = Calibration.load(target)
    assert loaded.intra.alpha > 0 or loaded.intra.beta > 0
    assert dict(loaded.by_world_size)[4] == four  # the other world size's entry survives
    assert dict(loaded.by_world_size)[2] == WorldLinks(loaded.intra, loaded.native)  # top level: latest fit
    assert loaded.inter == old_inter  # one node: inter is not measured and keeps the file's value
    for expected in ("# intra", "# native", "worst factor", f"kept the value from {target}"):
        assert expected in out
    written = f"Calibration written to {target} # for world size 2; the file has entries for world sizes 2, 4"
    assert written in out


def test_worst_factor_is_printed_as_is_and_a_poor_fit_is_warned_about():
    """One definition: the largest of predicted/measured and measured/predicted (11× prints 11.00x, not
    10.00x), and a fit off by more than 2× says its predictions cannot be trusted."""
    from meshwise.bench.calibrate import CalibrationOutcome, LinkFit, _fit, format_outcome

    link = LinkParams(1e-5, 1e-9, 0.0)
    exact = [  # a ring all_gather priced by the model itself: fitted exactly
        RunResult("all_gather", "gloo", "ring", 4, tuple(
            Row(s, s // 16, "float32", "none", -1, *[Figures(1, 1, 1, 0, 0, t * 1e6, t * 1e6)] * 2)
            for s in (4096, 1 << 16, 1 << 20, 1 << 22)
            for t in [predict_seconds("all_gather", "ring", s, 4, link)]
        ))
    ]  # fmt: skip
    assert _fit("intra", exact).worst_factor == pytest.approx(1.0, abs=1e-6)
    outcome = CalibrationOutcome(
        "cal.json", (LinkFit("intra", link, 11.0, 12), LinkFit("native", link, 1.5, 9)), (), 4, (4,)
    )
    text = format_outcome(outcome)
    assert "11.00x" in text and "1.50x" in text and "10.00x" not in text
    assert "warning: the intra fit is poor: some size is off by 11.00x" in text
    assert "native fit is poor" not in text


def test_merge_fit_sets_this_world_size_and_the_top_level():
    a, b, c = LinkParams(1e-5, 1e-9, 0.0), LinkParams(2e-5, 2e-9, 0.0), LinkParams(3e-5, 3e-9, 0.0)
    first = merge_fit(Calibration.builtin(), 2, a, b, c)
    assert first == Calibration(a, b, c, ((2, WorldLinks(a, c)),))
    second = merge_fit(first, 4, c, b, a)
    assert second == Calibration(c, b, a, ((2, WorldLinks(a, c)), (4, WorldLinks(c, a))))
    assert merge_fit(second, 2, b, b, b).for_world(2) == Calibration(b, b, b)  # a re-run replaces its entry


def _calibrate_two_nodes(path):
    from meshwise.bench.calibrate import calibrate

    world = meshwise.init("gloo", timeout=30)
    sweep = SweepConfig("all_reduce", (1024, 16384, 262144), iters=2, warmup=1, checks=0)
    outcome = calibrate(world.comm, world.comm, [0, 0, 1, 1], sweep, torch.device("cpu"), path, None)
    meshwise.shutdown()
    if outcome is None:
        return None
    return [(f.name, f.samples, f.worst_factor is not None) for f in outcome.links], outcome.path


def test_calibrate_splits_intra_and_inter_links_on_a_two_node_layout(tmp_path):
    """Ranks {0,1} and {2,3} pretend to be two nodes: intra from each pair, inter from ranks 0 and 2."""
    path = str(tmp_path / "two_nodes.json")
    results = spawn(_calibrate_two_nodes, 4, (path,), timeout=100)
    assert results[1:] == [None, None, None]
    links, saved = results[0]
    # 4 plans (3 for native) × 3 sizes each; intra and inter run on 2-rank groups, native on all 4 ranks
    assert links == [("intra", 12, True), ("inter", 12, True), ("native", 9, True)]
    assert saved == path and Calibration.load(path).inter.alpha >= 0


def test_algorithms_take_their_long_names_and_the_calibration_is_named_not_found(tmp_path, monkeypatch):
    job = build_job(_args("all_reduce", "--algo", "rabenseifner,recursive-doubling,rhd"))[0]
    assert job.algorithms == ("rhd", "rd") and job.pricing_file is None  # built-in unless a file is named
    monkeypatch.setenv("HOME", str(tmp_path))
    Calibration(LinkParams(1e-5, 1e-9, 0.0), LinkParams(1e-5, 1e-9, 0.0)).save(
        tmp_path / ".cache/meshwise/calibration.json"
    )
    assert build_job(_args("all_reduce", "--algo", "auto"))[0].pricing_file is None  # the cache is not read
    named = str(tmp_path / ".cache/meshwise/calibration.json")
    assert build_job(_args("all_reduce", "--calibration-file", named))[0].pricing_file == named
