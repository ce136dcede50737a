"""Joint admission through a coordinator with two nodes (issue 34, item 3): execs that
need a core and the one slot of an API, sent to a node, wait for the slot though both
nodes have a free core, then run one at a time across the nodes (by their own clocks)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_harness import InProcessDaemon, two_one_core_nodes
from harness import API_HELD, api_execs_wait_then_run_one_at_a_time

CONFIG = """
[cluster]
heartbeat_s = 0.25
heartbeat_timeout_s = 1.0

[[api]]
name = "search"
concurrency = 1
"""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, InProcessDaemon]]:
    """A coordinator and nodes ``a`` and ``b`` of one core each; logs must stay clean."""
    with two_one_core_nodes(tmp_path, CONFIG) as daemons:
        yield daemons


def test_cores_and_api_execs_through_a_node_run_one_at_a_time(
    cluster: dict[str, InProcessDaemon],
) -> None:
    node = cluster["a"]
    with node.client() as c:
        lease = c.acquire_lease("search")  # the slot is held: every exec waits for it

        def while_waiting(rows: list[dict]) -> None:  # though both nodes have a free core
            assert c.story(rows[0]["action_id"])["waiting_for"] == API_HELD

        api_execs_wait_then_run_one_at_a_time(node.socket, c, lease, while_waiting)
