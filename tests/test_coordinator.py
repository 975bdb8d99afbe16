"""The multi-node coordinator without namespaces: launchers (NodeLinks on 127.0.0.1) that disagree are
all refused; a failure halts the other nodes, every node restarts together behind a barrier, the
verdict carries one flight report merged from every node's dumps; a lost node ends the job."""

import json
import socket

import pytest

from meshwise.runtime import node_link
from meshwise.runtime.coordinator import Coordinator
from meshwise.runtime.node_link import NodeLink
from meshwise.runtime.spawn import free_port


def _dump(rank, seq, state):
    record = {"seq": seq, "call": "all_reduce(float32[4], sum)", "site": "train.py:9", "state": state,
              "started": 1.0, "ended": None}  # fmt: skip
    recorder = {"group": "world", "rank": rank, "world_size": 4, "records": [record]}
    return {"rank": rank, "reason": "asked", "time": 2.0, "recorders": [recorder]}


@pytest.fixture
def job(request):
    """A coordinator for 2 nodes x 2 ranks (max restarts from the test's parameter) and a way to join."""
    port = free_port()
    restarts = getattr(request, "param", 0)
    coordinator = Coordinator("127.0.0.1", port, 2, 2, restarts, join_timeout=60)
    links = []

    def join(node, nnodes=2):
        hello = {"node_rank": node, "nnodes": nnodes, "nprocs": 2, "max_restarts": restarts}
        links.append(NodeLink.join("127.0.0.1", port, hello, timeout=10, waiting=lambda: None))
        return links[-1]

    yield join
    for link in links:
        link.close()
    coordinator.close(linger=0.5)


def test_launchers_that_disagree_are_all_refused(job):
    node0, node1 = job(0), job(1, nnodes=3)
    for link in (node0, node1):
        order = link.next_order()
        assert order["kind"] == "error"
        assert order["message"].startswith("--nnodes differs between launchers: node 0 says 2, node 1")


def test_a_node_rank_claimed_twice_is_refused(job):
    first, second = job(1), job(1)
    for link in (first, second):
        assert "node rank 1 was claimed by two launchers" in link.next_order()["message"]
    # node 0's own launcher may say hello after the refusal: it hears the same one, not silence
    late = job(0)
    order = late.next_order()
    assert order["kind"] == "error" and "node rank 1 was claimed by two launchers" in order["message"]


@pytest.mark.parametrize("job", [1], indirect=True)
def test_a_failure_halts_every_node_and_all_restart_with_one_merged_report(job):
    node0, node1 = job(0), job(1)
    starts = [link.next_order() for link in (node0, node1)]
    assert [o["kind"] for o in starts] == ["start", "start"] and starts[0]["run_id"] == starts[1]["run_id"]
    cause = "node 1's rank 3 failed (exit code 7)"
    node1.send({"kind": "failed", "attempt": 0, "cause": cause, "status": 7})
    assert node0.orders.get(timeout=10) == {"kind": "halt", "cause": cause}
    node1.send(
        {"kind": "ended", "attempt": 0, "status": 7, "cause": cause, "dumps": {"2": _dump(2, 5, "started")}}
    )
    assert node0.orders.empty()  # no verdict before node 0's workers are gone too: a barrier
    node0.send(
        {"kind": "ended", "attempt": 0, "status": 1, "cause": cause, "dumps": {"0": _dump(0, 6, "started")}}
    )
    for link in (node0, node1):
        order = link.next_order()
        assert order["kind"] == "start" and order["attempt"] == 1 and order["cause"] == cause
        assert "rank 2 never entered collective #6" in "\n".join(order["summary"])
        assert "ranks 1,3 sent no records" in order["summary"][-1]
        assert "== rank 3: no dump" in order["report"]
    for link in (node0, node1):
        link.send({"kind": "ended", "attempt": 1, "status": 0, "cause": None, "dumps": {}})
    assert [link.next_order() for link in (node0, node1)] == [{"kind": "exit", "status": 0}] * 2


@pytest.mark.parametrize("job", [1], indirect=True)
def test_a_lost_node_ends_the_job_even_with_restarts_left(job):
    node0, node1 = job(0), job(1)
    assert node0.next_order()["kind"] == node1.next_order()["kind"] == "start"
    node1.close()
    halt = node0.orders.get(timeout=10)
    assert halt["kind"] == "halt" and halt["cause"].startswith("node 1 (ranks 2-3) lost: its launcher's")
    node0.send({"kind": "ended", "attempt": 0, "status": 1, "cause": halt["cause"], "dumps": {}})
    verdict = node0.next_order()
    assert verdict["kind"] == "exit" and verdict["status"] == 1 and verdict["cause"] == halt["cause"]


def test_a_silent_launcher_is_lost_after_the_silence_limit(job, monkeypatch):
    """A machine that dies without closing its connections (power, a cut cable) sends nothing more:
    after SILENCE_SECONDS (shortened here) it is lost, as one whose connection closed."""
    monkeypatch.setattr(node_link, "SILENCE_SECONDS", 2.0)
    monkeypatch.setattr(node_link, "PING_SECONDS", 0.2)  # the live links keep talking
    node0 = job(0)
    silent = socket.create_connection(("127.0.0.1", node0.sock.getpeername()[1]))
    hello = {"kind": "hello", "node_rank": 1, "nnodes": 2, "nprocs": 2, "max_restarts": 0}
    silent.sendall((json.dumps(hello) + "\n").encode())  # and then never a ping
    assert node0.next_order()["kind"] == "start"
    halt = node0.orders.get(timeout=10)
    assert halt["cause"] == "node 1 (ranks 2-3) lost: no word from its launcher for 2 s"
    silent.close()


def test_nodes_that_never_join_are_named():
    port = free_port()
    coordinator = Coordinator("127.0.0.1", port, 3, 2, 0, join_timeout=0.5)
    hello = {"node_rank": 0, "nnodes": 3, "nprocs": 2, "max_restarts": 0}
    link = NodeLink.join("127.0.0.1", port, hello, timeout=10, waiting=lambda: None)
    try:
        order = link.next_order()
        assert order == {
            "kind": "error",
            "message": "nodes 1, 2 did not join within 0.5 s; "
            "start a `meshwise run` with each missing --node-rank",
        }
    finally:
        link.close()
        coordinator.close(linger=0.1)
