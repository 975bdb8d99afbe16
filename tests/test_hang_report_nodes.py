"""``meshwise hang-report DIR...``: the dumps of two nodes merged into one report naming the rank behind;
bad directories fail with one line. (A multi-node launch merges every node's dumps itself: see
test_coordinator.py and test_multinode.py.)"""

import json

from meshwise.cli import main

DONE = (56, "all_reduce(float32[10], sum)", "model.py:88", "completed")
WAITING = (57, "all_reduce(float32[1024], sum)", "train.py:42", "started")


def _write(directory, rank, ops, now=100.0):
    records = [
        {"seq": seq, "call": call, "site": site, "state": state, "started": 90.0, "ended": None}
        for seq, call, site, state in ops
    ]
    recorder = {"group": "world", "rank": rank, "world_size": 4, "records": records}
    body = {"rank": rank, "reason": f"timeout on rank {rank}", "time": now, "recorders": [recorder]}
    directory.mkdir(exist_ok=True)
    (directory / f"rank{rank}.json").write_text(json.dumps(body))


def test_two_nodes_dumps_merge_into_one_report(tmp_path, capsys):
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    for rank in (0, 1):
        _write(node0, rank, [DONE, WAITING])
    _write(node1, 2, [DONE])  # rank 2 never entered #57; rank 3 sent nothing
    assert main(["hang-report", str(node0), str(node1), "-o", str(tmp_path / "report.txt")]) == 0
    out = capsys.readouterr().out
    assert "3 of 4 ranks dumped" in out
    assert "ranks 0,1 wait in all_reduce(float32[1024], sum) #57 at train.py:42 (for 10.0 s)" in out
    assert "rank 2 never entered collective #57: its last op was all_reduce(float32[10], sum) #56" in out
    assert "rank 3 sent no records" in out
    report = (tmp_path / "report.txt").read_text()
    assert "== rank 2" in report and "== rank 3: no dump" in report
    # one shared directory holding a stale and a fresh dump of the same rank: the fresh one counts
    _write(node1, 1, [DONE], now=50.0)
    assert main(["hang-report", str(node0), str(node1)]) == 0
    assert "ranks 0,1 wait in" in capsys.readouterr().out


def test_bad_directories_fail_with_one_line(tmp_path, capsys):
    assert main(["hang-report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a directory; pass each node's --flight-dir" in err[0]
    assert main(["hang-report", str(tmp_path)]) == 2
    assert "no rank*.json flight dumps in" in capsys.readouterr().err
