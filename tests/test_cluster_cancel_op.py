"""The ``cancel`` op on a coordinator with two nodes (``InProcessCluster``: the real
daemons, link and process backend): a cancel sent to any node's socket reaches the
coordinator, which ends a queued exec there and has the node holding a running one kill
it (``cancel_exec``); no process of it is left when the cancel is answered.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from cluster_harness import InProcessDaemon, two_one_core_nodes, wait_for

from tangram import AsyncClient, Client

CONFIG = """
[cluster]
heartbeat_s = 0.25
heartbeat_timeout_s = 2.0
"""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, InProcessDaemon]]:
    """A coordinator and nodes ``a`` and ``b`` of one core each; logs must stay clean."""
    with two_one_core_nodes(tmp_path, CONFIG) as daemons:
        yield daemons


def marker() -> str:
    return str(uuid.uuid4().int % 10**9)


def marked(mark: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if mark in " ".join(proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def env_on(c: Client, node: str) -> str:
    """Open environments until one lands on ``node`` (placement balances memory)."""
    for _ in range(8):
        env = c.request("env.open", {})
        if env["node"] == node:
            return str(env["id"])
    raise AssertionError(f"no environment landed on {node}")


def in_thread(fn: Any) -> dict[str, Any]:
    box: dict[str, Any] = {}

    def run() -> None:
        box["result"] = fn()

    box["thread"] = threading.Thread(target=run, daemon=True)
    box["thread"].start()
    return box


def test_cancel_a_queued_and_a_running_exec_on_a_cluster(
    cluster: dict[str, InProcessDaemon],
) -> None:
    """Node a's client runs an exec on node a and queues a second behind it; a cancel
    through node a ends the queued one; a cancel through node b kills the running one on
    node a, background child and all, and both clients are told ``cancelled``."""
    a, b = cluster["a"], cluster["b"]
    mark, queued_mark = marker(), marker()
    with a.client() as c:
        env = env_on(c, "a")
        first = in_thread(
            lambda: a.client().exec(f"sleep 300.{mark} & sleep 301.{mark}; wait", env=env)
        )
        rows = wait_for(lambda: c.queue()["running"], 20, "the exec running")
        running_id = rows[0]["action_id"]
        wait_for(lambda: len(marked(mark)) >= 2, 20, "both sleeps started")
        second = in_thread(lambda: a.client().exec(f"sleep 302.{queued_mark}", env=env))
        rows = wait_for(lambda: c.queue()["waiting"], 20, "the second exec queued")
        queued_id = rows[0]["action_id"]

        answer = c.cancel(queued_id)
        assert answer == {
            "action_id": queued_id,
            "cancelled": True,
            "state": "done",
            "outcome": "cancelled",
        }
        second["thread"].join(20)
        assert second["result"].outcome == "cancelled"
        assert not marked(queued_mark)

    with b.client() as other:  # through the other node's socket
        answer = other.cancel(running_id)
        assert answer["outcome"] == "cancelled", answer
        assert marked(mark) == []  # gone before the answer
        first["thread"].join(20)
        result = first["result"]
        assert result.outcome == "cancelled" and result.node == "a", result
        assert other.story(running_id)["outcome"] == "cancelled"
        assert other.cancel(running_id)["state"] == "done"  # ended: its outcome
        # the node's core is free again
        assert other.exec("true", env=env).outcome == "ok"


def test_cancelling_an_async_exec_through_a_node_kills_it(
    cluster: dict[str, InProcessDaemon],
) -> None:
    """An ``AsyncClient`` on node a whose exec runs on node b: cancelling the coroutine
    sends ``cancel`` by the exec's ref, forwarded to the coordinator, and node b kills it."""
    a = cluster["a"]
    mark = marker()
    with a.client() as c:
        env = env_on(c, "b")

    async def scenario() -> str:
        async with AsyncClient(a.socket) as ac:
            task = asyncio.ensure_future(ac.exec(f"sleep 300.{mark} & wait", env=env))
            await asyncio.to_thread(wait_for, lambda: marked(mark), 20, "the exec running")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.to_thread(wait_for, lambda: not marked(mark), 10, "killed")
            return (await ac.exec("true", env=env)).outcome

    assert asyncio.run(scenario()) == "ok"


def test_cancel_a_jobs_execs_on_two_nodes_through_a_node(
    cluster: dict[str, InProcessDaemon],
) -> None:
    """Job j runs one exec on node a and one on node b and queues a third behind the one
    on a; `cancel` with job and all through node b ends the queued one and has both nodes
    kill theirs: nothing of them is left when it answers; another job's exec runs on."""
    a, b = cluster["a"], cluster["b"]
    mark, other_mark = marker(), marker()
    with a.client() as c:
        env_a, env_b = env_on(c, "a"), env_on(c, "b")
        job = Client(a.socket, job="j")
        runs = [
            in_thread(lambda e=e: Client(a.socket, job="j").exec(f"sleep 300.{mark}", env=e))
            for e in (env_a, env_b)
        ]
        wait_for(lambda: len(c.queue()["running"]) == 2, 20, "both execs running")
        wait_for(lambda: len(marked(mark)) >= 2, 20, "both sleeps started")
        queued = in_thread(lambda: job.exec(f"sleep 302.{mark}", env=env_a))
        other = in_thread(
            lambda: Client(a.socket, job="k").exec(f"sleep 1.{other_mark}", env=env_b)
        )
        wait_for(lambda: len(c.queue()["waiting"]) == 2, 20, "two execs queued")
        ids = {
            row["action_id"]
            for row in c.queue()["running"] + c.queue()["waiting"]
            if row["job"] == "j"
        }
    with b.client() as through_b:
        answer = through_b.cancel_job("j")
        assert answer["job"] == "j"
        assert {row["action_id"] for row in answer["actions"]} == ids
        assert all(row["outcome"] == "cancelled" for row in answer["actions"]), answer
        assert marked(mark) == []  # killed on both nodes before the answer
    for box in (*runs, queued):
        box["thread"].join(20)
        assert box["result"].outcome == "cancelled", box["result"]
    other["thread"].join(30)
    assert other["result"].outcome == "ok", other["result"]
    job.close()
