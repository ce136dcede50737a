"""A GPU call the coordinator gives up on is stopped on its node (issue 33): real
coordinator and node in this process (tests/cluster_harness.py), torch services on
simulated GPUs (as tests/test_cluster_services.py).

Past a call's deadline (its timeout_s plus `[gpu] restore_timeout_s` plus `[cluster]
node_request_timeout_s`) the coordinator sends `stop_call`; the node kills the replica's
workers as `tangramd up` does with a call past its timeout and answers `call_stopped`;
only then does the call end `infra_error` and its GPU go back to the pool.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_harness import InProcessCluster, check_clean, off_the_table, record_links, stop_all
from harness import pid_alive, service_worker_pid

from tangram.testing import wait_for

SERVICES = Path(__file__).parent / "data" / "services"
sys.path.insert(0, str(SERVICES))
from tiny_services import expected  # noqa: E402  # the services' own formula, without torch

TIMEOUT_S = 6.0  # the call's own timeout: its handler (SLEEP_S) stays within it
SLEEP_S = 5.9
REQUEST_TIMEOUT_S = 2.0
# the coordinator's deadline for the call: TIMEOUT_S + 0.1 + REQUEST_TIMEOUT_S = 8.1 s;
# the node's restore (0.06 GB at 0.015 GB/s: 4 s) plus the handler takes at least 9.9 s,
# though the node honours every timeout of its own: a slow node, alive
COORDINATOR = f"""
[sched]
coalesce_ms = 1.0
[gpu]
restore_timeout_s = 0.1
[cluster]
node_request_timeout_s = {REQUEST_TIMEOUT_S}
"""
SLOW_NODE = """
[gpu]
simulated = { count = 1, mem_gb = 0.1, h2d_gbps = 0.015 }
nvml = false
"""


@pytest.fixture
def here(tmp_path: Path) -> Iterator[InProcessCluster]:
    with InProcessCluster(tmp_path, env={"TANGRAM_VALIDATE": "1"}) as cluster:
        yield cluster


def test_a_call_past_its_deadline_is_stopped_on_its_node_before_its_gpu_is_reused(
    here: InProcessCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call whose node restores slowly and then runs its handler, within the node's own
    timeouts, outlives the coordinator's deadline: the node is told to stop it, kills its
    worker (the pid is gone) and says so; the call ends `infra_error` naming the node; a
    call waiting for that GPU meanwhile is sent there only after the node confirmed,
    restores the replica afresh (a new worker) and answers right."""
    seen = record_links(monkeypatch)
    coord = here.coordinator(COORDINATOR)
    node = here.node(coord, "a", config=SLOW_NODE)
    with coord.client(timeout_s=120) as c:
        c.service_register("s", mem_gb=0.06, entry="tiny_services:small", path=str(SERVICES))
        started = tmp_path / "started"
        results: dict[str, Any] = {}

        def call(key: str, payload: dict[str, Any]) -> None:
            with coord.client(timeout_s=120) as own:
                results[key] = own.call("s", payload, timeout_s=TIMEOUT_S)

        slow = threading.Thread(
            target=call, args=("slow", {"x": 1.0, "sleep": SLEEP_S, "started": str(started)})
        )
        slow.start()
        wait_for(started.exists, 60, "the slow call in its handler")
        pid = wait_for(lambda: service_worker_pid(c), 30, "the worker in service list", every_s=0.2)
        assert pid_alive(pid)
        nxt = threading.Thread(target=call, args=("next", {"x": 2.0}))
        nxt.start()  # waits for the node's one GPU
        slow.join(120)
        nxt.join(120)
        res, again = results["slow"], results["next"]
        assert res.outcome == "infra_error", res
        assert f"node a did not answer run_call for call {res.action_id}" in (res.error or "")
        wait_for(lambda: not pid_alive(pid), 30, "the stopped call's worker gone")
        assert again.outcome == "ok" and again.node == "a" and again.gpus == (0,), again
        assert again.result is not None and again.result["y"] == expected(1000, 0.5, 2.0)
        assert again.result["pid"] != pid and again.restore_s > 0.0, again  # restarted
        kinds = [(m["t"], m.get("action_id")) for m in seen]
        assert ("stop_call", res.action_id) in kinds, kinds
        stopped = kinds.index(("call_stopped", res.action_id))
        assert stopped < kinds.index(("run_call", again.action_id)), kinds
        (confirm,) = [m for m in seen if m["t"] == "call_stopped"]
        assert confirm["was"] == "running", confirm
        assert not off_the_table(seen)
        assert "node_suspect" in coord.log()
    stop_all([coord, node])
    check_clean(coord, node)
