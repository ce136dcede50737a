"""Joint admission through a coordinator with two nodes (issue 34, item 3): execs that
need a core and the one slot of an API, sent to a node, wait for the slot though both
nodes have a free core, then run one at a time across the nodes (by their own clocks)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster_harness import InProcessDaemon, two_one_core_nodes, wait_for

from tangram import Client

CONFIG = """
[cluster]
heartbeat_s = 0.25
heartbeat_timeout_s = 1.0

[[api]]
name = "search"
concurrency = 1
"""
TIMED = "date +%s.%N; sleep 0.3; date +%s.%N"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, InProcessDaemon]]:
    """A coordinator and nodes ``a`` and ``b`` of one core each; logs must stay clean."""
    with two_one_core_nodes(tmp_path, CONFIG) as daemons:
        yield daemons


def test_cores_and_api_execs_through_a_node_run_one_at_a_time(
    cluster: dict[str, InProcessDaemon],
) -> None:
    results: list = []
    node = cluster["a"]
    with node.client() as c:
        lease = c.acquire_lease("search")  # the slot is held: every exec waits for it

        def submit() -> None:
            with Client(node.socket) as own:
                results.append(own.exec(TIMED, api="search", timeout_s=60))

        threads = [threading.Thread(target=submit) for _ in range(3)]
        for t in threads:
            t.start()
        held = "api search: 1 of 1 slots held"

        def all_wait_for_the_api() -> list | None:
            rows = c.queue()["waiting"]
            waits = [r["waiting_for"] for r in rows]
            return rows if len(rows) == 3 and waits == [held] * 3 else None

        waiting = wait_for(all_wait_for_the_api, 30, "three execs waiting for the API")
        assert c.story(waiting[0]["action_id"])["waiting_for"] == held
        c.release_lease(lease)
        for t in threads:
            t.join(60)
    assert len(results) == 3 and all(r.outcome == "ok" for r in results), results
    spans = sorted(tuple(float(x) for x in r.stdout.split()) for r in results)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end, spans  # never two at once, on either node
