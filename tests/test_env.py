"""Launch-environment detection as a pure function: every launcher's contract and every error case."""

import importlib.util
import os

import pytest

from meshwise.runtime.env import LaunchEnv, LaunchEnvError, detect_launch_env, job_port, resolve_ipv4

TORCHRUN = {
    "RANK": "5",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29400",
    "TORCHELASTIC_RUN_ID": "job7",
    "TORCHELASTIC_RESTART_COUNT": "2",
}
# srun task 5 of 8 on two nodes, gpu01 and gpu02, with 4 tasks each.
SLURM = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_JOB_NODELIST": "gpu[01-02]",
    "SLURM_TASKS_PER_NODE": "4(x2)",
}
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "6",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "PMIX_RANK": "6",
    "PMIX_NAMESPACE": "prterun-host-1234@1",
}
HYDRA = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, LaunchEnv("local", 0, 0, 1, 1, 0, None, None)),
        (
            {"PATH": "/bin", "SLURM_JOB_ID": "9", "MASTER_ADDR": "stale"},
            LaunchEnv("local", 0, 0, 1, 1, 0, None, None, job_id="9"),
        ),
        (TORCHRUN, LaunchEnv("torchrun", 5, 1, 8, 4, 1, "10.0.0.1", 29400, "job7", 2, node_count=2)),
        (
            {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"},
            LaunchEnv("torchrun", 0, 0, 1, 1, 0, None, None),
        ),
        # torchrun inside an srun allocation: torchrun's own variables win over the agent's SLURM task.
        (
            {**SLURM, **TORCHRUN},
            LaunchEnv("torchrun", 5, 1, 8, 4, 1, "10.0.0.1", 29400, "job7", 2, node_count=2),
        ),
        (SLURM, LaunchEnv("slurm", 5, 1, 8, 4, 1, "gpu01", 29500 + 123456 % 20000, "123456", node_count=2)),
        (  # exported MASTER_* win over the derived ones; step variables win over the job's
            {
                **SLURM,
                "MASTER_ADDR": "10.1.1.1",
                "MASTER_PORT": "12355",
                "WORLD_SIZE": "3",
                "SLURM_STEP_NUM_TASKS": "3",
                "SLURM_STEP_NODELIST": "cn[7-8]",
                "SLURM_STEP_TASKS_PER_NODE": "2,1",
                "SLURM_PROCID": "2",
                "SLURM_LOCALID": "0",
            },
            LaunchEnv("slurm", 2, 0, 3, 1, 1, "10.1.1.1", 12355, "123456", node_count=2),
        ),
        (  # uneven tasks per node: node 2 of a 2(x2),1 layout runs 1 task (3 nodes, not 5 // 1)
            {
                **SLURM,
                "SLURM_NTASKS": "5",
                "SLURM_JOB_NODELIST": "a[1-2],b7",
                "SLURM_TASKS_PER_NODE": "2(x2),1",
                "SLURM_NODEID": "2",
                "SLURM_PROCID": "4",
                "SLURM_LOCALID": "0",
            },
            LaunchEnv("slurm", 4, 0, 5, 1, 2, "a1", 29500 + 123456 % 20000, "123456", node_count=3),
        ),
        (OPENMPI, LaunchEnv("openmpi", 6, 2, 8, 4, 1, None, None, "prterun-host-1234@1")),
        # mpirun inside an sbatch allocation: the batch step's SLURM_PROCID=0 leaks into every rank.
        (
            {**SLURM, "SLURM_PROCID": "0", **OPENMPI},
            LaunchEnv("openmpi", 6, 2, 8, 4, 1, None, None, "prterun-host-1234@1"),
        ),
        (HYDRA, LaunchEnv("pmi", 3, 1, 4, 2, 1, None, None)),
        ({"PMI_RANK": "0", "PMI_SIZE": "1"}, LaunchEnv("pmi", 0, 0, 1, 1, 0, None, None)),
        (
            {"PMIX_RANK": "2", "WORLD_SIZE": "4", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "h0"},
            LaunchEnv("pmi", 2, 0, 4, 2, 1, "h0", None),
        ),
        # srun --mpi=pmix: PMIx and SLURM agree, SLURM adds the node list and job id.
        (
            {**SLURM, "PMIX_RANK": "5"},
            LaunchEnv("slurm", 5, 1, 8, 4, 1, "gpu01", 29500 + 123456 % 20000, "123456", node_count=2),
        ),
        # mpiexec.hydra bootstrapping its proxies through srun: the proxy's SLURM task is not the rank.
        (
            {**SLURM, "SLURM_PROCID": "1", "SLURM_NTASKS": "8", **HYDRA},
            LaunchEnv("pmi", 3, 1, 4, 2, 1, None, None),
        ),
        # the batch script itself (no srun step) is one process, not rank 0 of the allocation
        (
            {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"} | {"SLURM_PROCID": "0"},
            LaunchEnv("local", 0, 0, 1, 1, 0, None, None, job_id="123456"),
        ),
    ],
    ids=[
        "nothing",
        "batch-shell",
        "torchrun",
        "torchrun-single",
        "torchrun-in-srun",
        "srun",
        "srun-step-overrides",
        "srun-uneven",
        "openmpi",
        "mpirun-in-sbatch",
        "hydra",
        "pmi-single",
        "pmix-world-size",
        "srun-pmix",
        "hydra-over-srun",
        "sbatch-script",
    ],
)
def test_detects_every_launcher(env, expected):
    assert detect_launch_env(env) == expected


def test_local_reads_process_environment(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert detect_launch_env().launcher == "torchrun"


def _without(env, *names):
    return {k: v for k, v in env.items() if k not in names}


@pytest.mark.parametrize(
    ("env", "fragments"),
    [
        (_without(TORCHRUN, "LOCAL_RANK"), ["torchrun variables are incomplete", "LOCAL_RANK missing"]),
        (_without(TORCHRUN, "RANK"), ["LOCAL_RANK, WORLD_SIZE set but RANK missing"]),
        (
            _without(TORCHRUN, "MASTER_PORT"),
            ["WORLD_SIZE=8 (several ranks must meet) but MASTER_PORT missing"],
        ),
        ({**TORCHRUN, "GROUP_RANK": "2"}, ["node rank 2 is outside 0..1"]),
        ({**TORCHRUN, "RANK": "eight"}, ["RANK='eight' is not an integer"]),
        ({**TORCHRUN, "RANK": "8"}, ["rank 8 is outside 0..7"]),
        ({**TORCHRUN, "LOCAL_RANK": "4"}, ["local rank 4 is outside 0..3"]),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "9"}, ["local world size 9 must be within 1..8"]),
        ({**TORCHRUN, "WORLD_SIZE": "0", "RANK": "0"}, ["world size 0 must be at least 1"]),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, ["master port 70000 is outside 1..65535"]),
        (
            _without(SLURM, "SLURM_LOCALID", "SLURM_JOB_NODELIST"),
            ["SLURM_JOB_NODELIST, SLURM_LOCALID missing"],
        ),
        ({**SLURM, "SLURM_TASKS_PER_NODE": "4(x3)"}, ["covers 3 nodes", "names 2"]),
        ({**SLURM, "SLURM_NTASKS": "6"}, ["sums to 8 tasks", "SLURM_NTASKS=6"]),
        ({**SLURM, "SLURM_NODEID": "2"}, ["SLURM_NODEID=2 is outside 0..1"]),
        ({**SLURM, "SLURM_JOB_NODELIST": "gpu[02-01]"}, ["runs backwards"]),
        ({**SLURM, "SLURM_JOB_ID": "abc"}, ["no digits"]),
        ({**SLURM, "WORLD_SIZE": "4"}, ["WORLD_SIZE=4 was exported", "started 8 ranks"]),
        ({**SLURM, "SLURM_LOCALID": "4"}, ["local rank 4 is outside 0..3"]),
        ({**OPENMPI, "PMIX_RANK": "2"}, ["conflicting ranks", "OMPI_COMM_WORLD_RANK=6", "PMIX_RANK=2"]),
        (_without(OPENMPI, "OMPI_COMM_WORLD_SIZE"), ["Open MPI variables are incomplete", "SIZE missing"]),
        ({**HYDRA, "PMIX_RANK": "1"}, ["conflicting ranks", "PMI_RANK=3", "PMIX_RANK=1"]),
        ({"PMIX_RANK": "1"}, ["PMI_SIZE missing"]),
        ({"PMI_SIZE": "4"}, ["PMI_SIZE set but PMI_RANK (or PMIX_RANK) missing"]),
        (_without(HYDRA, "MPI_LOCALNRANKS"), ["MPI_LOCALRANKID set but MPI_LOCALNRANKS missing"]),
        ({**HYDRA, "PMI_RANK": "4", "MPI_LOCALRANKID": "0"}, ["rank 4 is outside 0..3"]),
        ({**HYDRA, "MPI_LOCALNRANKS": "0"}, ["MPI_LOCALNRANKS=0 must be at least 1"]),
        ({**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "0"}, ["OMPI_COMM_WORLD_LOCAL_SIZE=0 must be at least 1"]),
    ],
)
def test_errors_name_the_variables(env, fragments):
    with pytest.raises(LaunchEnvError) as info:
        detect_launch_env(env)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_job_port_range_and_determinism():
    assert job_port("0") == 29500
    assert job_port("19999") == 49499
    assert job_port("20000") == 29500
    assert job_port("4242_7") == job_port("42427")  # array jobs: the digits of the id
    assert all(29500 <= job_port(str(j)) < 49500 for j in range(0, 10**6, 9973))


def test_resolve_ipv4():
    assert resolve_ipv4("127.0.0.1") == "127.0.0.1"
    assert resolve_ipv4("localhost").startswith("127.")
    with pytest.raises(LaunchEnvError, match="does not resolve to an IPv4"):
        resolve_ipv4("no-such-host.invalid")


def test_info_reports_the_detected_layout_as_json(monkeypatch, capsys, tmp_path):
    import json

    from meshwise.cli import main

    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "PMI")) or name in TORCHRUN or name == "MPI_LOCALRANKID":
            monkeypatch.delenv(name)
    for name, value in SLURM.items():
        monkeypatch.setenv(name, value)
    assert main(["info", "--json", str(tmp_path / "info.json")]) == 0
    report = json.loads((tmp_path / "info.json").read_text())
    assert report["launch"]["launcher"] == "slurm"
    assert (report["launch"]["rank"], report["launch"]["world_size"], report["launch"]["num_nodes"]) == (
        5,
        8,
        2,
    )
    assert report["launch"]["master_addr"] == "gpu01"
    assert report["auto"]["device"] == "cpu" and report["backends"]["gloo"]["available"]
    assert report["devices"][0]["device"] == "cpu" and report["devices"][0]["cores"] >= 1
    assert report["shm"]["total_bytes"] > 0
    mpi = report["backends"]["mpi"]  # found without initialising MPI; names the version and mpirun
    assert mpi["available"] == (importlib.util.find_spec("mpi4py") is not None)
    assert mpi["note"].startswith("mpi4py " if mpi["available"] else "pip install")
    monkeypatch.setenv("SLURM_NTASKS", "6")
    assert main(["info"]) == 1
    assert "launcher    ERROR: SLURM layout" in capsys.readouterr().out


def test_pmi_without_local_variables_leaves_the_local_layout_to_the_mpi_bootstrap():
    layout = detect_launch_env(_without(HYDRA, "MPI_LOCALNRANKS", "MPI_LOCALRANKID"))
    assert layout.launcher == "pmi" and layout.rank == 3 and not layout.local_layout_known
    assert detect_launch_env(HYDRA).local_layout_known


def test_plan_ranks_spawns_locally_or_joins_the_launcher():
    from meshwise.runtime.env import plan_ranks

    local = plan_ranks(None, default=2, environ={})
    assert (local.world_size, local.launched) == (2, False)
    assert plan_ranks(3, default=2, environ={}).world_size == 3
    launched = plan_ranks(None, default=2, environ=OPENMPI)
    assert launched.launched and launched.world_size == int(OPENMPI["OMPI_COMM_WORLD_SIZE"])
    with pytest.raises(ValueError, match="conflicts with the"):
        plan_ranks(99, default=2, environ=OPENMPI)
    with pytest.raises(ValueError, match="-np must be at least 1"):
        plan_ranks(0, default=2, environ={})


def test_info_says_which_calibration_auto_would_price_with(tmp_path, monkeypatch, capsys):
    import json

    from meshwise.cli import main
    from meshwise.comm.cost import Calibration, LinkParams

    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "PMI")) or name in TORCHRUN or name == "MPI_LOCALRANKID":
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    out = tmp_path / "info.json"
    assert main(["info", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["calibration"]["source"] == "built-in"
    cal = Calibration(LinkParams(1e-5, 1e-9, 0.0), LinkParams(1e-5, 1e-9, 0.0)).save(tmp_path / "cal.json")
    assert main(["info", "--json", str(out), "--calibration-file", str(cal)]) == 0
    assert json.loads(out.read_text())["calibration"]["source"] == str(cal)
    assert main(["info", "--calibration-file", str(tmp_path / "none.json")]) == 1
    assert "calibration ERROR: calibration file" in capsys.readouterr().out
