"""``meshwise run``: the torchrun contract, fail-fast teardown with no survivors, restarts, Ctrl-C, sbatch."""

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from meshwise.cli import main
from meshwise.runtime.launch import LaunchPlan, launch, python_command
from meshwise.runtime.preflight import NodeNetwork
from meshwise.runtime.sbatch import SbatchSpec, render_sbatch
from meshwise.runtime.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]


def _script(tmp_path: Path, name: str, *parts: str) -> str:
    """Write a worker script from source parts, each dedented on its own."""
    path = tmp_path / name
    path.write_text("\n".join(textwrap.dedent(part) for part in parts))
    return str(path)


def _cli(*args: str, timeout: float = 60) -> tuple[int, str, str, float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "meshwise", "run", *args], capture_output=True, text=True, timeout=timeout
    )
    return done.returncode, done.stdout, done.stderr, time.monotonic() - start


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie waiting to be reaped by init."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _pids(directory: Path) -> list[int]:
    return [int(p.read_text()) for p in directory.glob("*.pid")]


def _assert_no_survivors(directory: Path) -> None:
    pids = _pids(directory)
    assert pids, "workers did not record their pids"
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = {p: Path(f"/proc/{p}/cmdline").read_bytes() for p in pids if _alive(p)}
    assert survivors == {}


# Each worker records its pid and that of a grandchild `sleep`, which must die with it.
RECORD_PIDS = """
    import os, subprocess, sys
    piddir = sys.argv[1]
    rank = os.environ["RANK"]
    child = subprocess.Popen(["sleep", "120"])
    open(f"{piddir}/rank{rank}.pid", "w").write(str(os.getpid()))
    open(f"{piddir}/rank{rank}-child.pid", "w").write(str(child.pid))
"""


def test_all_reduce_of_the_ranks_is_three_on_every_rank(tmp_path):
    script = _script(
        tmp_path,
        "allreduce.py",
        """
        import torch, torch.distributed as dist
        dist.init_process_group("gloo", init_method="env://")
        x = torch.tensor([dist.get_rank()])
        dist.all_reduce(x)
        print(f"sum {x.item()}")
        dist.destroy_process_group()
        """,
    )
    code, out, err, _ = _cli("-n", "3", script)
    assert code == 0, err
    # 0 + 1 + 2 = 3 on every rank: each worker got a distinct rank and they all met.
    assert sorted(line for line in out.splitlines() if "sum" in line) == [
        f"[rank {r}] sum 3" for r in range(3)
    ]


def test_ranks_taking_turns_print_in_turn_and_the_launcher_is_named(tmp_path):
    """Lines written before a barrier come out before the lines written after it, on stdout and stderr
    (the launcher frozen meanwhile: tests/test_run_output.py); a last line without newline is not lost;
    and messages name `meshwise run`, not the torchrun contract it speaks."""
    script = _script(
        tmp_path,
        "turns.py",
        """
        import sys, torch.distributed as dist
        from meshwise.runtime.env import plan_ranks
        dist.init_process_group("gloo", init_method="env://")
        rank, world = dist.get_rank(), dist.get_world_size()
        for turn in range(6):
            for who in range(world):
                if who == rank:
                    print(f"turn {turn} rank {rank}")
                    print(f"turn {turn} rank {rank} on stderr", file=sys.stderr)
                dist.barrier()
        try:
            plan_ranks(5, default=2)
        except ValueError as exc:
            print(exc)
        dist.destroy_process_group()
        sys.stdout.write(f"no newline from {rank}")
        """,
    )
    code, out, err, _ = _cli("-n", "2", script)
    assert code == 0, err
    turns = [line for line in out.splitlines() if " turn " in line]
    assert turns == [f"[rank {r}] turn {t} rank {r}" for t in range(6) for r in range(2)]
    turns = [line for line in err.splitlines() if " turn " in line]
    assert turns == [f"[rank {r}] turn {t} rank {r} on stderr" for t in range(6) for r in range(2)]
    assert "-np 5 conflicts with the 2 ranks meshwise run started" in out
    assert "[rank 0] no newline from 0" in out and "[rank 1] no newline from 1" in out


def test_failing_rank_stops_the_group_and_is_named(tmp_path):
    script = _script(
        tmp_path,
        "exit7.py",
        RECORD_PIDS,
        """
    import time
    if rank == "1":
        time.sleep(0.5)
        print("rank 1 gives up", file=sys.stderr)
        sys.exit(7)
    time.sleep(120)
    """,
    )
    code, _, err, elapsed = _cli("-np", "3", script, str(tmp_path))
    assert code == 7
    assert elapsed < 30
    assert "rank 1 failed (exit code 7)" in err
    assert "terminating ranks 0, 2" in err
    assert "[rank 1] rank 1 gives up" in err and err.count("rank 1 gives up") == 1  # streamed, once
    assert "(its stderr is above)" in err
    _assert_no_survivors(tmp_path)


def test_a_failed_ranks_traceback_is_printed_once(tmp_path):
    script = _script(
        tmp_path,
        "raise.py",
        """
    import os, time
    if os.environ["RANK"] == "1":
        raise ValueError("the input is bad")
    time.sleep(120)
    """,
    )
    code, _, err, _ = _cli("-np", "2", script)
    assert code == 1
    assert err.count("Traceback (most recent call last)") == 1, err
    assert err.count("ValueError: the input is bad") == 1, err
    # the line naming the rank comes after its traceback
    assert err.index("[rank 1] ValueError: the input is bad") < err.index("meshwise run: rank 1 failed")


def test_rank_hung_in_collective_is_killed_when_another_raises(tmp_path):
    """Rank 2 blocks in an all_reduce that only rank 1 could complete (rank 1 sleeps): no peer of rank 2
    dies, so gloo cannot notice anything and only the launcher can end the hang when rank 0 raises."""
    script = _script(
        tmp_path,
        "hang.py",
        RECORD_PIDS,
        """
    import datetime, time, torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=600))
    pair = dist.new_group([1, 2])
    if rank == "2":
        open(f"{piddir}/entered", "w").write("")
        dist.all_reduce(torch.ones(1), group=pair)  # waits for rank 1, for up to 10 minutes
        open(f"{piddir}/left", "w").write("")
    elif rank == "1":
        time.sleep(600)
    else:
        while not os.path.exists(f"{piddir}/entered"):
            time.sleep(0.05)
        time.sleep(0.5)  # rank 2 is now inside the all_reduce
        open(f"{piddir}/failed-at", "w").write(repr(time.time()))
        raise ValueError("rank 0 broke while rank 2 waited in all_reduce")
    """,
    )
    code, _, err, elapsed = _cli("-n", "3", script, str(tmp_path))
    ended = time.time()
    assert code == 1
    # The launcher's reaction is what must be fast; three torch imports on a busy 2-core box are not.
    assert ended - float((tmp_path / "failed-at").read_text()) < 10
    assert elapsed < 60
    assert not (tmp_path / "left").exists()  # rank 2 was killed inside the collective
    assert "rank 0 failed (exit code 1); terminating ranks 1, 2" in err
    assert "ValueError: rank 0 broke while rank 2 waited in all_reduce" in err
    _assert_no_survivors(tmp_path)


def test_unmodified_torch_ddp_script_trains_three_steps():
    code, out, err, _ = _cli(
        "-n", "2", str(ROOT / "examples" / "ddp_template.py"), "--steps", "3", timeout=90
    )
    assert code == 0, err
    assert "[rank 0] step 3 loss" in out
    for rank in range(2):
        assert (
            f"[rank {rank}] rank {rank}/2 local_rank {rank} on cpu: trained 3 steps, parameters in sync"
            in out
        )


def test_the_example_also_runs_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "examples" / "ddp_template.py"), "--steps", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("trained 2 steps, parameters in sync") == 2


def test_worker_environment_contract_multi_node():
    """Node 1 of 2 numbers its ranks after node 0's, and its workers bind the interface that routes to
    the master unless the user named one (the launch itself is tested across namespaces)."""
    plan = LaunchPlan(("x",), 2, nnodes=2, node_rank=1, master_addr="10.9.8.7")
    env = plan.worker_environment(1, plan.port(), 0, "run")
    assert env["RANK"] == "3" and env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "4"
    assert env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_RANK"] == "1" and env["GROUP_WORLD_SIZE"] == "2"
    assert env["MASTER_ADDR"] == "10.9.8.7" and env["MASTER_PORT"] == "29500"
    network = NodeNetwork("10.9.8.7", "10.9.8.8", "eth1")
    assert network.worker_environment({}) == {"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}
    assert network.worker_environment({"GLOO_SOCKET_IFNAME": "ib0"}) == {"NCCL_SOCKET_IFNAME": "eth1"}


def test_torchrun_spellings_of_the_flags_are_accepted(tmp_path):
    """Replacing `torchrun` by `meshwise run` in an existing command line must just work."""
    script = _script(
        tmp_path, "env.py", "import os\nprint(os.environ['WORLD_SIZE'], os.environ['MASTER_PORT'])\n"
    )
    port = str(free_port())
    code, out, err, _ = _cli("--nproc_per_node=2", "--master_port", port, "--max_restarts=0", script)
    assert code == 0, err
    assert sorted(out.splitlines()) == [f"[rank 0] 2 {port}", f"[rank 1] 2 {port}"]


def test_max_restarts_relaunches_the_group(tmp_path):
    script = _script(
        tmp_path,
        "flaky.py",
        """
        import os, sys
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if attempt < 2 and os.environ["RANK"] == "1":
            sys.exit(3)
        print(f"done on attempt {attempt}")
        """,
    )
    out, err = io.StringIO(), io.StringIO()
    assert launch(python_command(script, []), 2, max_restarts=2, stdout=out, stderr=err) == 0
    assert "restart 1 of 2" in err.getvalue() and "restart 2 of 2" in err.getvalue()
    lines = out.getvalue().splitlines()
    assert [line for line in lines if line.startswith("[rank 1]")] == ["[rank 1] done on attempt 2"]
    assert "[rank 0] done on attempt 2" in lines
    err = io.StringIO()
    assert launch(python_command(script, []), 2, max_restarts=1, stdout=out, stderr=err) == 3
    assert "rank 1 failed (exit code 3)" in err.getvalue()


def test_signal_death_and_timeout_are_reported(tmp_path):
    killer = _script(tmp_path, "kill.py", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    err = io.StringIO()
    assert launch(python_command(killer, []), 1, stdout=io.StringIO(), stderr=err) == 128 + signal.SIGKILL
    assert "rank 0 failed (killed by SIGKILL)" in err.getvalue()
    sleeper = _script(tmp_path, "sleep.py", RECORD_PIDS, "import time\ntime.sleep(120)\n")
    err = io.StringIO()
    start = time.monotonic()
    code = launch(python_command(sleeper, [str(tmp_path)]), 2, timeout=3, stdout=io.StringIO(), stderr=err)
    assert code == 124 and time.monotonic() - start < 15
    assert "still running after 3 s" in err.getvalue()
    _assert_no_survivors(tmp_path)


def _start_ready_workers(tmp_path: Path, *parts: str) -> subprocess.Popen:
    """``meshwise run -n 2`` of a script that prints 'ready' and sleeps; returns once both are ready."""
    script = _script(
        tmp_path, "wait.py", *parts, "import time\nprint('ready', flush=True)\ntime.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshwise", "run", "-n", "2", script, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready = 0
    while ready < 2:
        line = proc.stdout.readline()
        assert line, "launcher ended before its workers were ready"
        ready += "ready" in line
    return proc


def test_ctrl_c_cleans_up_every_worker(tmp_path):
    proc = _start_ready_workers(tmp_path, RECORD_PIDS)
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 130
    assert time.monotonic() - start < 15  # teardown: SIGTERM, at most a 5 s grace, SIGKILL
    assert "SIGINT received, stopping all workers" in err
    _assert_no_survivors(tmp_path)


def test_workers_and_their_children_die_with_a_launcher_killed_by_sigkill(tmp_path):
    """SIGKILL cannot be caught: the parent-death signal set before exec takes the workers down, and the
    reaper kills the `sleep` each of them started."""
    proc = _start_ready_workers(tmp_path, RECORD_PIDS)
    assert len(_pids(tmp_path)) == 4
    proc.kill()
    proc.communicate(timeout=20)
    _assert_no_survivors(tmp_path)


SLEEPER = """
import os, time

def sleep_forever(piddir):
    open(f"{piddir}/rank{os.environ['RANK']}.pid", "w").write(str(os.getpid()))
    time.sleep(300)
"""
SPAWNER = """
import sys
sys.path.insert(0, sys.argv[1])
import sleeper
from meshwise.runtime.spawn import spawn
spawn(sleeper.sleep_forever, 2, (sys.argv[1],), timeout=300)
"""


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_spawned_ranks_do_not_outlive_their_parent(tmp_path, how):
    """`-np N` commands run function ranks from a forkserver; `scancel` or `kill -9` of the command
    must not leave them computing (or waiting in a collective) as orphans."""
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    proc = subprocess.Popen([sys.executable, "-c", SPAWNER, str(tmp_path)])
    deadline = time.monotonic() + 60
    while len(_pids(tmp_path)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.1)
    proc.send_signal(how)
    proc.wait(timeout=20)
    _assert_no_survivors(tmp_path)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", "0", "x.py"], "-np/-n must be at least 1"),
        (["-n", "2", "does-not-exist.py"], "script 'does-not-exist.py' does not exist"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "x.py"],
            "--node-rank 2 is outside 0..1",
        ),
        (["--nnodes", "2", "x.py"], "--nnodes > 1 needs --master-addr"),
        (["--nnodes", "2", "--master-addr", "h", "--master-port", "65535", "x.py"], "leaves no port"),
        (["--print-sbatch", "-np", "4", "--gpus-per-node", "2", "x.py"], "-np <= --gpus-per-node"),
        (["--print-sbatch", "--time", "1 hour", "x.py"], "is not a SLURM time"),
        (["--no-python", "-m", "x"], "exclude each other"),
        (["--print-sbatch", "--no-python", "-m", "x"], "exclude each other"),
        (["--master-port", "70000", "x.py"], "--master-port 70000 is outside 1..65535"),
    ],
)
def test_bad_arguments_are_refused_before_launching(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("raise SystemExit('must not run')\n")
    assert main(["run", *args]) == 2
    assert message in capsys.readouterr().err


def test_unknown_executable_is_refused(capsys):
    assert main(["run", "--no-python", "-n", "2", "/nonexistent/binary"]) == 2
    assert "cannot find executable '/nonexistent/binary'" in capsys.readouterr().err


def test_print_sbatch_matches_the_committed_example(capsys):
    args = ["--print-sbatch", "--nnodes", "2", "-np", "4", "--gpus-per-node", "4", "--cpus-per-task", "8"]
    args += ["--time", "00:30:00", "--job-name", "ddp-template", "examples/ddp_template.py", "--steps", "100"]
    assert main(["run", *args]) == 0
    assert capsys.readouterr().out == (ROOT / "examples" / "ddp_template.sbatch").read_text()


def test_torchrun_sbatch_layout():
    text = render_sbatch(
        SbatchSpec("train.py", ("--lr", "0.1"), nodes=3, tasks_per_node=4, gpus_per_node=4, mode="torchrun")
    )
    assert "#SBATCH --nodes=3\n#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=32\n" in text
    assert '--nproc-per-node=4 --rdzv-id="$SLURM_JOB_ID" --rdzv-backend=c10d' in text
    assert '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"' in text
    assert 'srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" torchrun' in text
    assert text.rstrip().endswith("train.py --lr 0.1")
    binary = render_sbatch(SbatchSpec("./a.out", nodes=2, tasks_per_node=2, python=False))
    assert binary.rstrip().endswith("task \\\n    ./a.out")
    binary = render_sbatch(SbatchSpec("./a.out", nodes=2, tasks_per_node=2, python=False, mode="torchrun"))
    assert "--no-python \\\n    ./a.out" in binary
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


FAKE_SRUN = """#!/bin/bash
# A one-node stand-in for srun: start SLURM_NTASKS copies of the command with srun's task variables.
printf '%s\\n' "$@" > "$(dirname "$0")/srun.args"
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NODEID=0 SLURM_STEP_ID=0 "$@" & pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


def python_on_path(bin_dir: Path, executable: str = sys.executable) -> Path:
    """A ``python`` in ``bin_dir`` that runs ``executable``. A wrapper, not a symlink: a venv is found
    from the path the interpreter is started by (``pyvenv.cfg`` next to it), so a symlink elsewhere to
    ``venv/bin/python`` starts the base interpreter without the venv's packages (torch missing)."""
    wrapper = bin_dir / "python"
    wrapper.write_text(f'#!/bin/sh\nexec "{executable}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def test_the_python_put_on_path_keeps_a_venv(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = python_on_path(bin_dir, str(tmp_path / "venv" / "bin" / "python"))
    prefix = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True)
    assert prefix.stdout.strip() == str(tmp_path / "venv")


def test_generated_sbatch_runs_an_unmodified_ddp_script(tmp_path):
    """Execute the tasks-mode script with a fake srun/scontrol: every task gets the right RANK and trains."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho localhost\n")
    python_on_path(bin_dir)
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    spec = SbatchSpec(
        str(ROOT / "examples" / "ddp_template.py"), ("--steps", "2"), tasks_per_node=2, cpus_per_task=1
    )
    job = tmp_path / "job.sbatch"
    job.write_text(render_sbatch(spec))
    port = free_port()
    while not 29500 <= port < 49500:  # a job id whose derived port is free right now
        port = free_port()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": str(port - 29500),
        "SLURM_NTASKS": "2",
    }
    env.update({"SLURM_CPUS_PER_TASK": "1", "SLURM_JOB_NODELIST": "localhost", "SLURM_TASKS_PER_NODE": "2"})
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    done = subprocess.run(["bash", str(job)], env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    # srun >= 22.05 does not inherit the batch script's CPUs per task: the script must pass them on.
    assert (bin_dir / "srun.args").read_text().splitlines()[:3] == [
        "--kill-on-bad-exit=1",
        "--cpus-per-task=1",
        "--cpu-bind=cores",
    ]
    for rank in range(2):
        assert f"rank {rank}/2 local_rank {rank} on cpu: trained 2 steps, parameters in sync" in done.stdout
