"""Two "hosts" (network namespaces, tests/netns.py), each running its own ``meshwise run --nnodes 2``
with no network variables set: collectives and training across them equal one host, a lost node stops
the other within 30 s naming it, ``--max-restarts`` restarts both nodes and training resumes from its
checkpoint, and launchers that disagree are refused in one line each before any worker starts."""

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import meshwise_here
from netns import NamespaceCluster, namespaces_unavailable

pytestmark = pytest.mark.skipif(bool(namespaces_unavailable()), reason=str(namespaces_unavailable()))

SRC = str(Path(__file__).resolve().parents[1] / "src")
#: what the node launchers inherit: no rendezvous or interface variables, as a new user would have it
_ENV = {
    **{
        k: v for k, v in os.environ.items() if not k.endswith("SOCKET_IFNAME") and not k.startswith("MASTER_")
    },
    "PYTHONPATH": SRC,
}
_MESHWISE = [sys.executable, "-m", "meshwise"]

ALL_REDUCE = """
import os, torch, meshwise
world = meshwise.init()
t = torch.arange(6, dtype=torch.int64) * (world.rank + 1)
world.comm.all_reduce(t)
print("RESULT", world.rank, world.node_rank, t.tolist(), os.environ["GLOO_SOCKET_IFNAME"])
meshwise.shutdown()
"""

LOOP = """
import time, torch, meshwise
world = meshwise.init(backend="gloo")
for step in range(100000):
    world.comm.all_reduce(torch.ones(4))
    if step == 0:
        print("running", flush=True)
    time.sleep(0.02)
"""

# Runs `meshwise train ...` in-process; in the first attempt rank 3 is killed once a checkpoint exists.
CRASH_ONCE = """
import os, signal, sys, threading, time
from pathlib import Path
from meshwise.cli import main
checkpoint = Path(sys.argv[1]) / "run.json"
if os.environ["RANK"] == "3" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    def die():
        while not checkpoint.exists():
            time.sleep(0.005)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=die, daemon=True).start()
sys.exit(main(sys.argv[2:]))
"""


def _script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def _node_args(
    cluster: NamespaceCluster, node: int, nnodes: int = 2, flight: Path | None = None
) -> list[str]:
    """``meshwise run`` on ``node``; with ``flight``, its flight reports go to ``flight/node<N>`` (not
    /tmp), one directory per launcher as on separate machines."""
    master = cluster.addresses[0]
    argv = [*_MESHWISE, "run", "--nnodes", str(nnodes), "--node-rank", str(node), "--master-addr", master]
    return argv if flight is None else [*argv, "--flight-dir", str(flight / f"node{node}")]


def _start(cluster, node, argv, env=None):
    return cluster.popen(
        node, argv, env=env or _ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _both(cluster, tail, timeout=110.0, extra=(), flight=None):
    """Run ``meshwise run --nnodes 2 ... -np 2 TAIL`` on both nodes; their (returncode, out, err)."""
    argvs = [[*_node_args(cluster, n, flight=flight), *extra, "-np", "2", *tail] for n in range(2)]
    procs = [_start(cluster, n, argv) for n, argv in enumerate(argvs)]
    outputs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, *output) for p, output in zip(procs, outputs, strict=True)]


def _one_host(argv: list[str]) -> str:
    """``meshwise ARGV -np 4`` in this process (conftest.meshwise_here), on this host: the one-host
    reference's stdout. Its 4 ranks form the same gloo ring as the two nodes' (the same reduction order)."""
    done = meshwise_here([*_MESHWISE, *argv, "-np", "4"])
    assert done.returncode == 0, done.stderr
    return done.stdout


def _summary(out: str, *keys: str) -> list[str]:
    """The summary lines starting with ``keys``, without the launcher's ``[rank 0]`` prefix."""
    lines = [line.removeprefix("[rank 0] ") for line in out.splitlines()]
    return [line for line in lines if line.startswith(keys)]


def test_all_reduce_across_two_nodes_with_nothing_set(tmp_path):
    """The auto-detected interface carries gloo (no 127.0.0.1 advertised) and integers sum exactly."""
    script = _script(tmp_path, "all_reduce.py", ALL_REDUCE)
    with NamespaceCluster(nodes=2) as cluster:
        results = _both(cluster, [script])
    lines = []
    for node, (code, out, err) in enumerate(results):
        assert code == 0, err
        lines += [line.split() for line in out.splitlines() if "RESULT" in line]
        assert all(f" {node} [" in line for line in out.splitlines() if "RESULT" in line)
    expected = str([i * (1 + 2 + 3 + 4) for i in range(6)]).replace(" ", "")
    assert sorted(int(words[3]) for words in lines) == [0, 1, 2, 3]
    for words in lines:
        assert "".join(words[5:-1]) == expected
        assert words[-1] == cluster.interfaces[int(words[4])]


@pytest.mark.slow
@pytest.mark.timeout(240)  # a one-host reference and a two-node run, 4 ranks each, on busy cores
def test_train_cnn_across_nodes_restarts_from_its_checkpoint_and_equals_one_host(tmp_path):
    """`--max-restarts 1`: rank 3 (node 1) dies after the first checkpoint; both nodes restart, resume,
    and end with the loss and accuracy of one host training straight through (same gloo ring over 4
    ranks, same reduction order: equal to the printed digits)."""
    train = ["train", "cnn", "--epochs", "4", "--backend", "gloo"]
    crash = _script(tmp_path, "crash_once.py", CRASH_ONCE)
    keys = ("Final train loss", "Validation accuracy")
    one_host = _one_host(train)
    with NamespaceCluster(nodes=2) as cluster:
        ckpt = str(tmp_path / "ckpt")
        tail = [crash, ckpt, *train, "--checkpoint", ckpt]
        results = _both(cluster, tail, extra=["--max-restarts", "1"], flight=tmp_path)
    for code, _, err in results:
        assert code == 0, err
        assert "restarting the workers of all 2 nodes (restart 1 of 1) after: node 1's rank 3 failed" in err
    node0_out = results[0][1]
    assert "resumed after epoch" in node0_out
    assert _summary(node0_out, *keys) == _summary(one_host, *keys) != []


@pytest.mark.slow
@pytest.mark.timeout(240)  # a one-host reference and a two-node run, 4 ranks each, on busy cores
def test_train_gpt_tensor_parallel_inside_nodes_data_parallel_across():
    data = str(Path(textwrap.__file__))
    gpt = ["train", "gpt", "--tp", "2", "--config", "gpt-tiny", "--data", data, "--seq-len", "32",
           "--global-batch", "4", "--steps", "3", "--backend", "gloo"]  # fmt: skip
    keys = ("Final train loss", "Validation loss")
    one_host = _one_host(gpt)
    with NamespaceCluster(nodes=2) as cluster:
        (code, out, err), (code1, _, err1) = _both(cluster, ["--no-python", *_MESHWISE, *gpt])
    assert code == code1 == 0, err + err1
    assert "mesh dp=2 tp=2" in out
    assert _summary(out, *keys) == _summary(one_host, *keys) != []


@pytest.mark.slow
def test_a_lost_node_stops_the_other_within_30_s_naming_it(tmp_path):
    script = _script(tmp_path, "loop.py", LOOP)
    with NamespaceCluster(nodes=2) as cluster:
        argvs = [[*_node_args(cluster, n, flight=tmp_path), "-np", "2", script] for n in range(2)]
        procs = [_start(cluster, n, argv) for n, argv in enumerate(argvs)]
        assert procs[1].stdout.readline().strip().endswith("running")
        cluster.kill_all(1)
        lost = time.monotonic()
        _, err = procs[0].communicate(timeout=60)
        elapsed = time.monotonic() - lost
    assert procs[0].returncode != 0
    assert elapsed < 30, f"node 0 took {elapsed:.1f} s to stop"
    assert "node 1 (ranks 2-3) lost: its launcher's connection closed" in err
    # one flight report over both nodes: node 0's ranks' records, node 1's ranks named as silent
    assert "ranks 0,1 failed in all_reduce(float32[4], sum)" in err
    assert "ranks 2,3 sent no records" in err
    report = err.split("full report with every rank's recent ops and Python stacks: ")[1].split()[0]
    assert Path(report).parent == tmp_path / "node0"
    assert "== rank 3: no dump" in Path(report).read_text()
    assert err.rstrip().endswith("the job failed: node 1 (ranks 2-3) lost: its launcher's connection closed "
                                 "(the launcher or its machine died)")  # fmt: skip


# ``meshwise ARGS`` timed from the moment its modules are imported: the pre-flight's own time, apart
# from starting an interpreter and importing torch (seconds on a loaded machine, and not ours to cut).
TIMED = """
import sys, time
from meshwise.cli import main
started = time.monotonic()
code = main(sys.argv[1:])
print(f"{time.monotonic() - started:.3f}")
sys.exit(code)
"""


def _timed(argv: list[str]) -> list[str]:
    assert argv[:3] == _MESHWISE
    return [sys.executable, "-c", TIMED, *argv[3:]]


def _refusal(proc):
    """(exit code, stderr lines, seconds the launcher took after its imports)."""
    out, err = proc.communicate(timeout=60)
    return proc.returncode, err.strip().splitlines(), float(out.split()[-1])


def test_launchers_that_disagree_are_refused_before_any_worker_starts(tmp_path):
    """Every launcher is refused in one line; the last one up hears it within the pre-flight limit (the
    others waited for it to import torch, which is not a pre-flight's time)."""
    script = _script(tmp_path, "never.py", "raise SystemExit('a worker must not start')\n")
    with NamespaceCluster(nodes=3) as cluster:
        # two launchers claim node 1 of 3 (node 2 never comes): all three refused
        argvs = [_timed([*_node_args(cluster, min(n, 1), 3, tmp_path / str(n)), script]) for n in range(3)]
        refusals = [_refusal(p) for p in [_start(cluster, n, argv) for n, argv in enumerate(argvs)]]
        for code, err, _ in refusals:
            assert code == 2 and len(err) == 1, err
            assert "node rank 1 was claimed by two launchers" in err[0]
            assert "give each node its own --node-rank in 0..2" in err[0]
        assert min(took for *_, took in refusals) < 5
        # --nnodes 2 on node 0, 3 on node 1
        argvs = [_timed([*_node_args(cluster, n, 2 + n, tmp_path), script]) for n in range(2)]
        refusals = [_refusal(p) for p in [_start(cluster, n, argv) for n, argv in enumerate(argvs)]]
        for code, err, _ in refusals:
            assert code == 2 and len(err) == 1, err
            assert "--nnodes differs between launchers: node 0 says 2, node 1" in err[0]
            assert "says 3; pass the same --nnodes on every node" in err[0]
        assert min(took for *_, took in refusals) < 5


@pytest.mark.parametrize(
    ("variables", "master", "message"),
    [
        ({}, "cut", "cannot reach the master 10.231.0.1:29501 from this node"),
        ({}, "127.0.0.1", "--master-addr 127.0.0.1 is a loopback address, which the other nodes"),
        ({"GLOO_SOCKET_IFNAME": "lo"}, None, "GLOO_SOCKET_IFNAME=lo is the loopback interface"),
        ({"NCCL_SOCKET_IFNAME": "eth9"}, None, "NCCL_SOCKET_IFNAME=eth9 selects none of this machine's"),
    ],
)
def test_a_node_that_cannot_take_part_says_why_in_one_line(tmp_path, variables, master, message):
    script = _script(tmp_path, "never.py", "raise SystemExit('a worker must not start')\n")
    with NamespaceCluster(nodes=2) as cluster:
        argv = _node_args(cluster, 1, flight=tmp_path)
        if master == "cut":  # node 0 is off the link: its address answers nothing
            cluster.set_link(0, up=False)
        elif master:
            argv[argv.index("--master-addr") + 1] = master
        proc = _start(cluster, 1, _timed([*argv, script]), env={**_ENV, **variables})
        code, err, took = _refusal(proc)
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert took < 5


def test_doctor_runs_the_same_checks_from_a_node():
    """`meshwise doctor --master-addr A` on node 1: the route and interface it would use, then the same
    one-line causes as the launcher's pre-flight for a loopback interface and an unreachable master."""

    def doctor(cluster, **variables):
        argv = [*_MESHWISE, "doctor", "-np", "2", "--json", "--master-addr", cluster.addresses[0]]
        return _start(cluster, 1, argv, env={**_ENV, **variables})

    def findings(proc):
        out, _ = proc.communicate(timeout=60)
        checks = json.loads(out)["checks"]
        return proc.returncode, {c["name"]: c for c in checks if c["name"] in ("route to master", "master")}

    with NamespaceCluster(nodes=2) as cluster:
        # the first two at once: each is one process, mostly importing torch on one core of two
        plain, loopback = doctor(cluster), doctor(cluster, GLOO_SOCKET_IFNAME="lo")
        code, found = findings(plain)
        route = found["route to master"]
        assert route["status"] == found["master"]["status"] == "pass", found
        assert f"10.231.0.2 on {cluster.interfaces[1]} leads to 10.231.0.1" in route["detail"]
        code, found = findings(loopback)
        route = found["route to master"]
        assert code == 1 and route["status"] == "fail"
        assert route["detail"].startswith("GLOO_SOCKET_IFNAME=lo is the loopback interface")
        assert route["fix"].startswith("unset it")
        cluster.set_link(0, up=False)
        code, found = findings(doctor(cluster))
        assert code == 1 and found["master"]["status"] == "fail"
        assert found["master"]["detail"].startswith("cannot reach the master 10.231.0.1:29501 from this node")
