"""The two-level communicator (``backend="auto"`` over several nodes: shm inside a node, gloo between).

One host stands in for several nodes through an explicit node map (``meshwise.init(node_map=...)``), so
these tests need no network namespaces. Every collective is checked against native gloo over the same
ranks with the collective matrix (integer-valued inputs: results must match bit for bit), with the
hierarchy forced on, on 2×1, 2×2 and 3×2 layouts; the node map itself is plain data.
"""

from __future__ import annotations

import time

import pytest
import torch

from collective_matrix import check_collectives
from conftest import joined
from meshwise.comm.topology import Topology
from meshwise.runtime.spawn import spawn

#: layouts as node maps: nodes × ranks per node, node ids deliberately not 0-based or sorted
LAYOUTS = {
    "2x1": [7, 3],
    "2x2": [5, 5, 2, 2],
    "3x2": [0, 0, 1, 1, 2, 2],
}
TWO_LEVEL = ("all_reduce", "all_gather", "broadcast")
INTEGERS = [torch.int32, torch.int64, torch.float32]  # float32 on small integers is exact too
SEGMENT = 64  # bytes: all_reduce crosses between nodes in several pieces even on test-sized vectors


def test_topology_is_plain_data_from_node_ids_not_hostnames():
    topo = Topology((5, 5, 2, 2, 9, 9))
    assert topo.nodes == 3 and topo.local_size == 2 and topo.uniform
    assert topo.members == ((0, 1), (2, 3), (4, 5))
    assert [topo.node_index(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [topo.local_rank(r) for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert topo.peers_across(3) == (1, 3, 5)
    assert topo.subset([1, 2, 3]).members == ((0,), (1, 2))


def test_uneven_nodes_have_no_single_local_size():
    topo = Topology((0, 0, 1))
    assert not topo.uniform
    with pytest.raises(ValueError, match=r"different numbers of ranks \(\[2, 1\]\)"):
        _ = topo.local_size
    with pytest.raises(ValueError, match="one node id per rank"):
        Topology(())


def _matrix_over_two_levels(node_map: list[int]) -> list[str]:
    from meshwise.comm.native import NativeCommunicator
    from meshwise.comm.two_level import TwoLevelCommunicator

    with joined("gloo", timeout=60) as world:
        reference = NativeCommunicator(None, timeout=60)
        comm = TwoLevelCommunicator.from_process_group(
            None, timeout=60, node_map=node_map, policy="hierarchical", segment_bytes=SEGMENT
        )
        try:
            several_per_node = len(node_map) > len(set(node_map))
            assert comm.levels["inter"] == "gloo" and (comm.levels["intra"] == "shm" or not several_per_node)
            failures = check_collectives(
                comm, reference, dtypes=INTEGERS, ops=["sum", "max"], sizes=[1, 7, 300], collectives=TWO_LEVEL
            )
            # every other collective goes to the flat transport: one pass of each, same reference
            failures += check_collectives(comm, reference, dtypes=[torch.int64], ops=["sum"], sizes=[5])
        finally:
            comm.close()
        return [f"rank {world.rank}: {f}" for f in failures]


@pytest.mark.parametrize("layout", ["2x1", "2x2", pytest.param("3x2", marks=pytest.mark.slow)])
def test_hierarchical_collectives_match_gloo_exactly(layout):
    node_map = LAYOUTS[layout]
    results = spawn(_matrix_over_two_levels, len(node_map), (node_map,), timeout=110)
    assert [f for per_rank in results for f in per_rank] == []


def _auto_world(node_map: list[int]) -> tuple[str, str, list[int]]:
    with joined("auto", timeout=60, node_map=node_map) as world:
        levels = world.comm.describe_levels()  # the instrumented wrapper forwards it
        data = torch.arange(10, dtype=torch.int64) * (world.rank + 1)
        world.comm.all_reduce(data)
        return world.backend, levels, data.tolist()


def test_auto_backend_uses_shared_memory_inside_and_gloo_across_nodes():
    results = spawn(_auto_world, 4, ([0, 0, 1, 1],), timeout=110)
    expected = (torch.arange(10) * 10).tolist()  # ranks 1+2+3+4
    for backend, levels, data in results:
        assert backend == "shm+gloo"
        assert levels.startswith("intra-node shm (2 ranks per node), inter-node gloo (2 nodes)")
        assert data == expected


def _calibrate_levels(path: str) -> list[str] | None:
    from meshwise.bench.calibrate import calibrate, format_outcome
    from meshwise.bench.runner import SweepConfig

    with joined("gloo", timeout=60) as world:
        sweep = SweepConfig("all_reduce", (1024, 16384, 262144), iters=2, warmup=1, checks=0)
        outcome = calibrate(world.comm, world.comm, [0, 0, 1, 1], sweep, torch.device("cpu"), path, None)
    return None if outcome is None else [format_outcome(outcome), *(f.name for f in outcome.levels)]


def test_calibrate_measures_both_levels_on_their_own_transports(tmp_path):
    from meshwise.comm.cost import Calibration

    path = str(tmp_path / "levels.json")
    results = spawn(_calibrate_levels, 4, (path,), timeout=110)
    text, *names = results[0]
    assert names == ["intra-node shm", "inter-node gloo", "flat gloo"]
    assert "# two-level links (backend auto over several nodes)" in text and "inter-node gloo" in text
    assert Calibration.load(path).levels is not None


def test_info_names_the_transport_of_each_level_on_several_nodes():
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
    }  # fmt: skip
    shown = subprocess.run(
        [sys.executable, "-m", "meshwise", "info"], env=env, capture_output=True, text=True, timeout=60
    ).stdout
    assert "auto        backend shm+gloo on cpu: intra-node shm, inter-node gloo" in shown.splitlines()


@pytest.mark.slow
def test_bench_multinode_runs_on_one_host_and_its_replicas_agree(tmp_path):
    """The benchmark script still matches the library (namespaces are not needed for that: --one-host)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "multinode.json"
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_multinode.py"
    done = subprocess.run(
        [sys.executable, str(script), "--one-host", "--sizes", "64K", "--calibration-sizes", "4K,64K,256K",
         "--iters", "1", "--rounds", "1", "--steps", "1", "--batch", "4", "--json", str(out)],
        capture_output=True, text=True, timeout=115,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["levels"].startswith("intra-node shm (2 ranks per node), inter-node gloo (2 nodes)")
    assert [fit["link"] for fit in result["fits"]] == ["intra-node shm", "inter-node gloo", "flat gloo"]
    assert [row["bytes"] for row in result["all_reduce"]] == [64 << 10]
    assert result["all_reduce"][0]["wrong_elements"] == 0
    assert result["ddp"]["max_weight_difference"] == 0.0


def _mesh_over_two_levels(node_map: list[int]) -> list[tuple[str, str, list[int]]]:
    from meshwise.comm.mesh import MeshShape

    with joined("auto", timeout=60, node_map=node_map, mesh=MeshShape(dp=2, tp=2)) as world:
        found = []
        for axis in ("tp", "dp"):
            comm = world.mesh[axis]
            data = torch.full((6,), world.rank + 1, dtype=torch.int64)
            comm.all_reduce(data)
            found.append((axis, comm.describe_levels(), data.tolist()))
        return found


def test_tensor_parallel_inside_a_node_and_data_parallel_across_split_into_two_level_groups():
    """tp pairs share a node (shm alone), dp pairs span the nodes (one rank per node: gloo)."""
    results = spawn(_mesh_over_two_levels, 4, ([0, 0, 1, 1],), timeout=110)
    for rank, found in enumerate(results):
        (_, tp_levels, tp_sum), (_, dp_levels, dp_sum) = found
        node, local = divmod(rank, 2)
        assert tp_sum == [sum(r + 1 for r in (2 * node, 2 * node + 1))] * 6
        assert dp_sum == [sum(r + 1 for r in (local, local + 2))] * 6
        assert tp_levels == "intra-node shm (2 ranks on one node)"
        assert dp_levels == "inter-node gloo (2 nodes, one rank on each)"


def _split_called_by_some(skip: str) -> str:
    """Ranks 0 and 1 split off [0, 1]; rank 2 either makes a different split (``other``) or none
    (``none``) and then waits. Returns the error each rank saw (or what it got)."""
    from meshwise.comm.api import CommError

    with joined("gloo", timeout=4) as world:
        comm = world.comm
        try:
            if world.rank < 2:
                sub = comm.split([0, 1])
                return f"got {sub!r}"
            if skip == "other":
                comm.split([0, 1, 2])
                return "split [0, 1, 2] returned"
            time.sleep(7)  # alive, but never joins the split
            return "skipped"
        except CommError as exc:
            return str(exc)


def test_a_split_that_only_some_ranks_make_is_an_error_naming_them_not_a_hang():
    """torch names each new group by how many this process has made, so a split that some ranks skip
    (or make with other members) would hang the next group they share; the split itself must say so."""
    started = time.monotonic()
    results = spawn(_split_called_by_some, 3, args=("other",), timeout=60)
    for rank in (0, 1, 2):
        assert "split" in results[rank] and "rank 2 asked for [0, 1, 2]" in results[rank], results
        assert "rank 0 asked for [0, 1]" in results[rank], results
    results = spawn(_split_called_by_some, 3, args=("none",), timeout=60)
    for rank in (0, 1):
        assert "ranks [2] did not call split" in results[rank], results
    assert results[2] == "skipped"
    assert time.monotonic() - started < 45
