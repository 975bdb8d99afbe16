"""SLURM host-list and task-count expansion, table-driven, including every malformed form we refuse."""

import pytest

from meshwise.runtime.hostlist import HostlistError, expand_hostlist, expand_task_counts


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node07", ["node07"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("gpu[008-010]", ["gpu008", "gpu009", "gpu010"]),  # padding kept across a carry
        ("n[9-11]", ["n9", "n10", "n11"]),  # no padding: widths grow
        ("n[0-1]", ["n0", "n1"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("x[1,3],y[5],z", ["x1", "x3", "y5", "z"]),
        ("c[1-2]a,c[4]b", ["c1a", "c2a", "c4b"]),
        ("  node[1-2]\n", ["node1", "node2"]),
        ("a, b[1-2]\tc", ["a", "b1", "b2", "c"]),  # SLURM also separates with spaces and tabs
        ("a,,b", ["a", "b"]),  # and, like SLURM, repeated separators count as one
        ("node-a.cluster.org", ["node-a.cluster.org"]),
    ],
)
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "names no host"),
        (" , ", "names no host"),
        ("node[1-2", "unclosed"),
        ("node1-2]", "without '['"),
        ("node[[1-2]]", "nested"),
        ("node[]", "empty or unclosed"),
        ("node[4-2]", "runs backwards"),
        ("node[a-b]", "not N or N-M"),
        ("node[1-]", "not N or N-M"),
        ("n[0-999999]x[0-9]", "expands to"),
    ],
)
def test_expand_hostlist_refuses_malformed(text, message):
    with pytest.raises(HostlistError, match=message.replace("[", r"\[")):
        expand_hostlist(text)


@pytest.mark.parametrize(
    ("text", "counts"),
    [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1,2(x2)", [1, 2, 2]), ("8(x1)", [8])],
)
def test_expand_task_counts(text, counts):
    assert expand_task_counts(text) == counts


@pytest.mark.parametrize("text", ["", "2(x)", "x2", "0", "2(x0)", "2,(x3)"])
def test_expand_task_counts_refuses_malformed(text):
    with pytest.raises(HostlistError):
        expand_task_counts(text)
