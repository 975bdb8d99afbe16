"""The namespace cluster fixture: nodes reach each other only on the test subnet, each has its own
loopback, a shaped link is shaped, and nothing is left behind, even when the block fails."""

import subprocess
import sys

import pytest

from netns import NamespaceCluster, namespaces_unavailable

pytestmark = pytest.mark.skipif(bool(namespaces_unavailable()), reason=str(namespaces_unavailable()))

_CONNECT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as s:
    print(s.recv(16).decode())
"""
_SERVE = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
conn, _ = srv.accept()
conn.sendall(b"hello")
"""


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


@pytest.mark.parametrize("nodes", [2, 3])
def test_nodes_talk_over_the_link_and_are_torn_down(nodes):
    before = _namespaces()
    with NamespaceCluster(nodes=nodes) as cluster:
        assert cluster.addresses[:2] == ["10.231.0.1", "10.231.0.2"]
        server = cluster.popen(0, [sys.executable, "-c", _SERVE, cluster.addresses[0], "29400"],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert server.stdout.readline().strip() == "listening"
        last = nodes - 1
        got = cluster.run(last, [sys.executable, "-c", _CONNECT, cluster.addresses[0], "29400"], timeout=30)
        assert got.stdout.strip() == "hello", got.stderr
        server.wait(10)
        lo = cluster.run(1, ["ip", "-o", "addr", "show", "dev", "lo"], timeout=10).stdout
        assert "127.0.0.1" in lo and cluster.addresses[0] not in lo
        names = set(cluster.names)
        assert names <= _namespaces()
    assert _namespaces() == before and not names & _namespaces()


def test_teardown_kills_what_runs_inside_even_when_the_block_fails():
    with pytest.raises(RuntimeError, match="boom"), NamespaceCluster(nodes=2, rate="100mbit") as cluster:
        sleeper = cluster.popen(1, ["sleep", "600"])
        qdisc = cluster.run(0, ["tc", "qdisc", "show", "dev", cluster.interfaces[0]], timeout=10).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        assert sleeper.pid in cluster.pids(1)
        raise RuntimeError("boom")
    assert sleeper.wait(5) == -9
    assert not set(cluster.names) & _namespaces()
