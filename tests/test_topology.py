"""Host topology discovery: NUMA grouping, affinity masks, memory."""

from __future__ import annotations

import os

import psutil
import pytest

from tangramd.topology import HostTopology, build_topology, discover, numa_cpulists, parse_cpulist


@pytest.mark.parametrize(
    ("text", "cores"),
    [("0", (0,)), ("0-3", (0, 1, 2, 3)), ("0-1,4,6-7\n", (0, 1, 4, 6, 7)), ("", ())],
)
def test_parse_cpulist(text, cores):
    """Kernel cpulists with ranges and singletons parse into sorted core ids."""
    assert parse_cpulist(text) == cores


CASES = [
    ("two nodes, all allowed", [(0, 1), (2, 3)], {0, 1, 2, 3}, ((0, 1), (2, 3))),
    ("mask drops a whole node", [(0, 1), (2, 3)], {2, 3}, ((2, 3),)),
    ("mask splits nodes", [(0, 1), (2, 3)], {1, 2}, ((1,), (2,))),
    ("no numa info", [], {0, 1}, ((0, 1),)),
    ("cores missing from sysfs", [(0,)], {0, 5}, ((0,), (5,))),
]


@pytest.mark.parametrize(
    ("numa", "allowed", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_build_topology(numa, allowed, expected):
    """Usable cores are the affinity mask, grouped by the NUMA node sysfs lists them under."""
    assert build_topology(numa, allowed, 123) == HostTopology(expected, 123)


def test_sysfs_nodes_are_read_in_node_order(tmp_path):
    """node10 sorts after node2: nodes are ordered numerically, not as strings."""
    for node, cpus in [("node10", "4-5"), ("node2", "2-3"), ("node0", "0-1")]:
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    (tmp_path / "possible").write_text("0-1\n")
    assert numa_cpulists(tmp_path) == [(0, 1), (2, 3), (4, 5)]


def test_discover_on_this_machine():
    """On the real host every usable core appears once and memory matches psutil."""
    topo = discover()
    assert sorted(topo.cores) == sorted(os.sched_getaffinity(0))
    assert len(set(topo.cores)) == len(topo.cores)
    assert topo.mem_bytes == psutil.virtual_memory().total
    assert all(node for node in topo.cores_by_numa)
