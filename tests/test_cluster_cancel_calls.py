"""`cancel` of a running GPU call through a coordinator with two nodes (issue 34 item 4):
real coordinator and nodes in this process (tests/cluster_harness.py), torch services on
simulated GPUs (as tests/test_cluster_services.py).

The coordinator tells the call's node to stop it (`stop_call`); the node kills the
replica's workers as `tangramd up` does and confirms (`call_stopped`); only then does the
call end `cancelled`, its GPU go back to the pool and the cancel answer. The node is not
drained as suspect for it (the call's deadline entry is cleared).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from cluster_harness import InProcessCluster, check_clean, off_the_table, record_links, stop_all
from harness import pid_alive, service_worker_pid

from tangram.client import AsyncClient
from tangram.protocol.errors import NotFound
from tangram.testing import wait_for, wait_for_async
from tangramctl.main import cli

SERVICES = Path(__file__).parent / "data" / "services"
sys.path.insert(0, str(SERVICES))
from tiny_services import expected  # noqa: E402  # the services' own formula, without torch

COORDINATOR = """
[sched]
coalesce_ms = 1.0
"""
NODE = """
[gpu]
simulated = { count = 1, mem_gb = 0.1, h2d_gbps = 1 }
nvml = false
"""


@pytest.fixture
def here(tmp_path: Path) -> Iterator[InProcessCluster]:
    with InProcessCluster(tmp_path, env={"TANGRAM_VALIDATE": "1"}) as cluster:
        yield cluster


def test_a_running_call_is_cancelled_on_its_node(
    here: InProcessCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call whose handler sleeps 30 s is cancelled (`tangramctl cancel ID --json`) while
    it runs on one of two nodes: the answer says cancelled once the node confirmed, the
    worker is gone, the caller and the story say cancelled, the node stays up (not
    suspect), and the next call restarts the replica on that node's freed GPU."""
    seen = record_links(monkeypatch)
    coord = here.coordinator(COORDINATOR)
    a = here.node(coord, "a", config=NODE)
    b = here.node(coord, "b", config=NODE)
    with coord.client(timeout_s=120) as c:
        c.service_register("s", mem_gb=0.06, entry="tiny_services:small", path=str(SERVICES))
        started = tmp_path / "started"
        results: dict[str, Any] = {}

        def call() -> None:
            with coord.client(timeout_s=120) as own:
                payload = {"x": 1.0, "sleep": 30.0, "started": str(started)}
                results["slow"] = own.call("s", payload, timeout_s=120)

        slow = threading.Thread(target=call)
        slow.start()
        wait_for(started.exists, 60, "the call in its handler")
        (row,) = c.queue()["running"]
        aid = row["action_id"]
        pid = wait_for(lambda: service_worker_pid(c), 30, "the worker in service list", every_s=0.2)
        out = CliRunner().invoke(cli, ["--socket", coord.socket, "cancel", aid, "--json"])
        assert out.exit_code == 0, out.output
        answer = json.loads(out.output)
        assert answer == {
            "action_id": aid,
            "cancelled": True,
            "state": "done",
            "outcome": "cancelled",
        }, answer
        slow.join(30)
        res = results["slow"]
        assert res.outcome == "cancelled" and res.result is None, res
        node = res.node
        assert node in ("a", "b"), res
        wait_for(lambda: not pid_alive(pid), 30, "the cancelled call's worker gone")
        story = c.story(aid)
        assert story["outcome"] == "cancelled", story
        assert any(event["event"] == "cancel" for event in story["events"]), story
        kinds = [(m["t"], m.get("action_id")) for m in seen]
        assert ("stop_call", aid) in kinds and ("call_stopped", aid) in kinds, kinds
        again = c.call("s", {"x": 2.0})
        assert again.outcome == "ok" and again.node == node and again.gpus == (0,), again
        assert again.result is not None and again.result["y"] == expected(1000, 0.5, 2.0)
        assert again.result["pid"] != pid and again.restore_s > 0.0, again  # restarted
        assert c.queue()["running"] == []
        assert not off_the_table(seen)
    assert "node_suspect" not in coord.log()
    stop_all([coord, a, b])
    check_clean(coord, a, b)


def test_a_call_is_cancelled_by_its_ref_through_a_node(
    here: InProcessCluster, tmp_path: Path
) -> None:
    """A call sent through a node's socket with a `ref` is found by `cancel {"ref"}` on
    that same connection (the node forwards the ref to the coordinator, as exec's): the
    call ends cancelled, its worker gone; the same ref on another connection of that node
    is not_found; the next call answers."""
    coord = here.coordinator(COORDINATOR)
    a = here.node(coord, "a", config=NODE)
    started = tmp_path / "started"
    with coord.client(timeout_s=120) as c:
        c.service_register("s", mem_gb=0.06, entry="tiny_services:small", path=str(SERVICES))

        async def scenario() -> tuple[dict[str, Any], Any, int]:
            async with AsyncClient(a.socket) as ac, AsyncClient(a.socket) as other:
                payload = {"x": 1.0, "sleep": 30.0, "started": str(started)}
                task = asyncio.ensure_future(ac.call("s", payload, ref="r1", timeout_s=120))
                await wait_for_async(lambda: started.exists() or task.done(), 60, "its handler")
                assert not task.done(), task
                pid = wait_for(lambda: service_worker_pid(c), 30, "the worker", every_s=0.2)
                with pytest.raises(NotFound, match="r1"):
                    await other.request("cancel", {"ref": "r1"})
                answer = await ac.request("cancel", {"ref": "r1"})
                return answer, await task, pid

        answer, res, pid = asyncio.run(scenario())
        assert answer["cancelled"] is True and answer["outcome"] == "cancelled", answer
        assert res.outcome == "cancelled" and res.action_id == answer["action_id"], res
        wait_for(lambda: not pid_alive(pid), 30, "the cancelled call's worker gone")
        assert c.story(answer["action_id"])["outcome"] == "cancelled"
        assert c.call("s", {"x": 2.0}).outcome == "ok"
    stop_all([coord, a])
    check_clean(coord, a)
