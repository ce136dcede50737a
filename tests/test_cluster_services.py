"""GPU services as cluster objects (issue 33 item 1): a real coordinator and real nodes in
this process (tests/cluster_harness.py), each node with `[gpu] simulated` GPUs and real
torch worker processes.

Each node has one simulated GPU of 0.1 GB, which holds one of the 0.06 GB services at a
time, so a second service on the same GPU evicts the first. The coordinator places the
replicas on its nodes' GPUs, a node runs what it is sent on its own service host, and
`service list` names the node of each replica.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from cluster_harness import (
    FaultProxy,
    InProcessCluster,
    InProcessDaemon,
    check_clean,
    off_the_table,
    record_links,
    stop_all,
    wait_node_state,
)

from tangram import Client
from tangram.client import CallResult
from tangram.protocol.errors import BadRequest
from tangram.testing import wait_for
from tangramctl.main import cli
from tangramd.cluster.link import split_host_port

SERVICES = Path(__file__).parent / "data" / "services"
sys.path.insert(0, str(SERVICES))
from tiny_services import expected  # noqa: E402  # the services' own formula, without torch

HEARTBEAT_TIMEOUT_S = 2.0  # the tests that lose a node; the others keep the default 10 s
COORDINATOR = """
[sched]
coalesce_ms = 1.0
"""
LOSES_NODES = f"""{COORDINATOR}
[cluster]
heartbeat_s = 0.1
heartbeat_timeout_s = {HEARTBEAT_TIMEOUT_S}
"""
NODE = """
[gpu]
simulated = { count = 1, mem_gb = 0.1, h2d_gbps = 1 }
nvml = false
"""
MEM_GB = 0.06  # two of these never share a 0.1 GB GPU
SIZES = {"small": (1000, 0.5), "medium": (3000, 1.5), "large": (5000, 2.5)}
# what the link carries about services, each message checked against the link table
GPU_MESSAGES = {
    "load_service",
    "unload_service",
    "run_call",
    "warm_service",
    "service_loaded",
    "service_unloaded",
    "call_done",
    "services_state",
}


def want(factory: str, x: float) -> float:
    n, bias = SIZES[factory]
    return expected(n, bias, x)


def ctl(daemon: InProcessDaemon, *args: str) -> Any:
    """``tangramctl --socket <daemon's> ARGS --json`` in this process: its JSON."""
    result = CliRunner().invoke(cli, ["--socket", daemon.socket, *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def register(c: Client, name: str, factory: str, **kw: Any) -> dict[str, Any]:
    return c.service_register(
        name, mem_gb=MEM_GB, entry=f"tiny_services:{factory}", path=str(SERVICES), **kw
    )


def rows(c: Client) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in c.service_list()}


def replicas(c: Client, name: str, state: str = "resident") -> list[tuple[str, list[int]]]:
    """``(node, gpus)`` of the service's replicas in ``state``."""
    return sorted((r["node"], r["gpus"]) for r in rows(c)[name]["replicas"] if r["state"] == state)


@pytest.fixture
def sent_on_links(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every message any link sends or defers during the test, in order."""
    return record_links(monkeypatch)


@pytest.fixture
def here(tmp_path: Path) -> Iterator[InProcessCluster]:
    with InProcessCluster(tmp_path, env={"TANGRAM_VALIDATE": "1"}) as cluster:
        yield cluster


def two_gpu_nodes(here: InProcessCluster, config: str = "") -> dict[str, InProcessDaemon]:
    """The coordinator (``COORDINATOR`` + ``config``) and nodes a and b, one GPU each."""
    coord = here.coordinator(COORDINATOR + config)
    return {
        "coordinator": coord,
        "a": here.node(coord, "a", config=NODE),
        "b": here.node(coord, "b", config=NODE),
    }


def finish(daemons: Mapping[str, InProcessDaemon]) -> None:
    stop_all(list(daemons.values()))
    check_clean(*daemons.values())


def call_in_background(
    daemon: InProcessDaemon, name: str, payload: dict[str, Any]
) -> tuple[threading.Thread, list[CallResult]]:
    """One call on its own connection to ``daemon``; the box gets its result."""
    box: list[CallResult] = []

    def call() -> None:
        with daemon.client(timeout_s=120) as c:
            box.append(c.call(name, payload))

    thread = threading.Thread(target=call)
    thread.start()
    return thread, box


# ---------------------------------------------------------------------- registration, calls


def test_services_are_registered_on_the_coordinator_and_called_through_any_node(
    here: InProcessCluster, sent_on_links: list[dict[str, Any]], tmp_path: Path
) -> None:
    """A registration made through a node (CLI) or on the coordinator's socket is loaded
    on every node with GPUs; `call` through either node runs on a node's GPUs and its
    `--json` names that node and its GPUs; two concurrent calls take both nodes' GPUs;
    `service list` names the node of each replica; a removal reaches every node. What the
    link carried about it passes the link table's check, each GPU message among it."""
    d = two_gpu_nodes(here)
    coord, a, b = d["coordinator"], d["a"], d["b"]
    options = ["--path", str(SERVICES), "--mem-gb", str(MEM_GB), "--json"]
    row = ctl(b, "service", "register", "s", "--entry", "tiny_services:small", *options)
    assert row["name"] == "s" and row["error"] is None, row
    assert sorted(r["node"] for r in row["replicas"]) == ["a", "b"], row  # a backup on each
    with coord.client(timeout_s=120) as c:
        register(c, "warm", "medium", min_resident=1)
        with pytest.raises(BadRequest, match="already registered differently"):
            register(c, "s", "large")
    # through either node: the node and the GPUs used are in the answer
    ran = []
    for daemon, x in ((a, 2.0), (b, 3.0)):
        out = ctl(daemon, "call", "s", "--json", "--", json.dumps({"x": x}))
        assert out["outcome"] == "ok" and out["result"]["y"] == want("small", x), out
        assert out["node"] in ("a", "b") and out["gpus"] == [0], out
        ran.append(out["node"])
    assert ran[0] == ran[1]  # resident there: the second call restores nothing
    # two at once: one GPU per node, so one runs on each
    slow = {"x": 1.0, "sleep": 1.0}
    calls = [call_in_background(daemon, "s", slow) for daemon in (a, b)]
    for thread, _ in calls:
        thread.join(60)
    done = [box[0] for _, box in calls]
    assert {r.node for r in done} == {"a", "b"}, done
    assert all(r.outcome == "ok" and r.result["y"] == want("small", 1.0) for r in done)
    with a.client(timeout_s=120) as c:
        wait_for(lambda: rows(c)["s"]["calls"] == 4, 30, "the nodes' rows")
        assert replicas(c, "s") == [("a", [0]), ("b", [0])]
        listed = ctl(a, "service", "list", "--json")["services"]
        assert all("node" in r for row in listed for r in row["replicas"]), listed
        assert rows(c)["warm"]["warm"] == 0  # evicted: s took both GPUs
        # once s is gone, the warm one (min_resident 1) is restored with no call
        c.service_remove("s")
        assert set(rows(c)) == {"warm"}
        wait_for(lambda: rows(c)["warm"]["warm"] == 1, 60, "the warm replica")
        assert c.call("warm", {"x": 1.0}).restore_s == 0.0
        c.service_remove("warm")
        assert rows(c) == {}
    for node in (a, b):
        wait_for(lambda node=node: '"service_removed"' in node.log(), 10, "the removal")
    finish(d)
    bad = off_the_table(sent_on_links)
    assert not bad, "\n".join(bad)
    assert {msg["t"] for msg in sent_on_links} >= GPU_MESSAGES


def test_a_module_that_fails_on_a_node_fails_the_registration_everywhere(
    here: InProcessCluster,
) -> None:
    """A factory that raises fails `service register` with the node's error (bad_request),
    and no node keeps it; a coordinator with no node with GPUs refuses a registration."""
    coord = here.coordinator(COORDINATOR)
    cpu_only = here.node(coord, "c")
    with cpu_only.client(timeout_s=120) as c, pytest.raises(BadRequest, match="no node with"):
        register(c, "s", "small")
    a = here.node(coord, "a", config=NODE)
    with coord.client(timeout_s=120) as c:
        with pytest.raises(BadRequest, match=r"node a: .*no weights here"):
            register(c, "bad", "broken")
        assert rows(c) == {}
        register(c, "s", "small")
        assert c.call("s", {"x": 1.0}).node == "a"
    d = {"coordinator": coord, "c": cpu_only, "a": a}
    finish(d)


def test_a_cold_call_is_placed_on_the_node_that_restores_it_fastest(
    here: InProcessCluster,
) -> None:
    """Node a joins first (the lowest GPU ids) with a slower copy bandwidth (`[gpu]
    simulated` h2d_gbps, reported in its hello) than node b: the first call of a service,
    resident nowhere, restores on b, the node whose own estimate is quicker (the story
    gives b's estimate); once resident there, the next call stays on b."""
    slow = NODE.replace("h2d_gbps = 1", "h2d_gbps = 0.25")
    coord = here.coordinator(COORDINATOR)
    a = here.node(coord, "a", config=slow)
    b = here.node(coord, "b", config=NODE)
    with coord.client(timeout_s=120) as c:
        register(c, "s", "small")
        out = ctl(coord, "call", "s", "--json", "--", json.dumps({"x": 2.0}))
        assert out["outcome"] == "ok" and out["result"]["y"] == want("small", 2.0), out
        assert out["node"] == "b" and out["gpus"] == [0] and out["restore_s"] > 0.0, out
        story = json.dumps(c.story(out["action_id"]))
        assert f"restore onto node=b gpus=[0] est_s={0.06 / 1:.3g}" in story, story
        again = c.call("s", {"x": 3.0})
        assert again.node == "b" and again.restore_s == 0.0, again
    finish({"coordinator": coord, "a": a, "b": b})


# ---------------------------------------------------------------------- evict and restore


def test_evictions_and_restores_run_on_the_node_that_holds_the_gpus(
    here: InProcessCluster,
) -> None:
    """Three services take turns on node g's one GPU, called through node c (no GPUs):
    each call evicts the one resident before it there and restores its own, and every
    answer is right (all the weights came back); the restore time is the node's. A new
    speed-up table (`service.set_eff`) reaches the node, which keeps the replica resident."""
    coord = here.coordinator(COORDINATOR)
    c_node = here.node(coord, "c")
    g = here.node(coord, "g", config=NODE)
    with c_node.client(timeout_s=120) as c:
        for name in SIZES:
            register(c, name, name)
        for turn in range(2):
            for name in SIZES:
                x = 1.0 + turn
                r = c.call(name, {"x": x})
                assert r.outcome == "ok" and r.result is not None, r
                assert r.result["y"] == want(name, x), r
                assert r.node == "g" and r.gpus == (0,), r
                assert r.restore_s > 0.0, r  # the one before it held the GPU
        assert c.call("large", {"x": 0.5}).restore_s == 0.0  # resident: no restore
        # a new speed-up table reaches the node, which keeps the replica as it is
        assert c.request("service.set_eff", {"name": "large", "eff": "1:1"})["eff"] == "1:1"
        assert c.call("large", {"x": 0.5}).restore_s == 0.0
        assert '"service_removed"' not in g.log()
        wait_for(lambda: sum(row["calls"] for row in rows(c).values()) == 8, 30, "the rows")
        listed = rows(c)
        assert sum(row["evictions"] for row in listed.values()) == 5, listed
        assert [row["restores"] for row in listed.values()] == [2, 2, 2], listed
        assert replicas(c, "large") == [("g", [0])]
    assert '"action_placed"' in g.log() and "evicts" in g.log()
    finish({"coordinator": coord, "c": c_node, "g": g})


# ---------------------------------------------------------------------- a node lost


def test_a_node_killed_mid_call_fails_its_call_and_the_next_call_restores_elsewhere(
    here: InProcessCluster, tmp_path: Path
) -> None:
    """A node killed while a call runs on its GPU: the call ends `infra_error` naming the
    node once the coordinator counts it lost, its replica leaves `service list` (its
    counters stay), and the service's next call restores a replica on the other node,
    with the right answer, at that node's restore-time estimate (its h2d bandwidth)."""
    fast = NODE.replace("h2d_gbps = 1", "h2d_gbps = 2")
    coord = here.coordinator(LOSES_NODES)
    a = here.node(coord, "a", config=NODE)
    b = here.node(coord, "b", config=fast)
    with coord.client(timeout_s=120) as c:
        register(c, "s", "small")
        first = c.call("s", {"x": 1.0})
        assert first.outcome == "ok" and first.restore_s > 0.0, first
        doomed = {"a": a, "b": b}[first.node or ""]
        other = b if doomed is a else a
        started = tmp_path / "started"
        thread, box = call_in_background(
            coord, "s", {"x": 1.0, "sleep": 60, "started": str(started)}
        )
        wait_for(started.exists, 60, "the call in its handler")
        doomed.kill()
        thread.join(HEARTBEAT_TIMEOUT_S + 30)
        (lost,) = box
        assert lost.outcome == "infra_error", lost
        assert f"node {doomed.name} lost" in (lost.error or ""), lost
        assert lost.node == doomed.name, lost
        # its replica went with it; the next call restores one on the other node
        assert replicas(c, "s") == []
        again = c.call("s", {"x": 4.0})
        assert again.outcome == "ok" and again.node == other.name, again
        assert again.result is not None and again.result["y"] == want("small", 4.0)
        assert again.restore_s > 0.0, again
        gbps = 2 if other is b else 1
        story = json.dumps(c.story(again.action_id))
        assert f"restore onto node={other.name} gpus=[0] est_s={0.06 / gbps:.3g}" in story
        wait_for(lambda: replicas(c, "s") == [(other.name, [0])], 30, "the new replica")
        assert rows(c)["s"]["calls"] >= 2  # the lost node's calls still count
    stop_all([coord, other])
    check_clean(coord, other)


# ---------------------------------------------------------------------- [[service]]


def test_config_services_are_deployed_by_the_coordinator_as_nodes_join(
    here: InProcessCluster,
) -> None:
    """The coordinator's `[[service]]` entries are registered at its start (listed before
    any node joins); nodes with GPUs load them as they join, a `min_resident = 1` one is
    restored before any call (its first call restores nothing), and a node's own
    `[[service]]` is not registered (it says so in its log)."""
    declared = f"""
[[service]]
name = "warm"
entry = "tiny_services:small"
path = "{SERVICES}"
mem_gb = {MEM_GB}
min_resident = 1

[[service]]
name = "cold"
entry = "tiny_services:medium"
path = "{SERVICES}"
mem_gb = {MEM_GB}
"""
    coord = here.coordinator(COORDINATOR + declared)
    with coord.client(timeout_s=120) as c:
        assert {name: row["replicas"] for name, row in rows(c).items()} == {
            "warm": [],
            "cold": [],
        }
        a = here.node(coord, "a", config=NODE + declared.replace('"warm"', '"mine"'))
        b = here.node(coord, "b", config=NODE)
        wait_for(lambda: rows(c)["warm"]["warm"] == 1, 60, "the warm replica")
        assert rows(c)["warm"]["restores"] == 1
        first = c.call("warm", {"x": 2.0})
        assert first.outcome == "ok" and first.restore_s == 0.0, first
        assert first.result is not None and first.result["y"] == want("small", 2.0)
        cold = c.call("cold", {"x": 1.0})  # the other GPU is free: nothing evicted
        assert cold.outcome == "ok" and cold.restore_s > 0.0 and cold.node != first.node
        assert set(rows(c)) == {"warm", "cold"}
    assert "config_services_not_registered" in a.log() and "mine" in a.log()
    assert "config_services_not_registered" not in coord.log()
    finish({"coordinator": coord, "a": a, "b": b})


def test_a_node_back_after_it_was_lost_restores_afresh(here: InProcessCluster) -> None:
    """A node cut off past the heartbeat timeout is lost (its replica leaves the pool); when
    its link is back it joins afresh and evicts what it still held, so the pool and the
    node agree: a call placed there restores again and answers right."""
    coord = here.coordinator(LOSES_NODES)
    proxy = FaultProxy(split_host_port(coord.join["coordinator"]))
    try:
        far = here.node(coord, "far", config=NODE, address=proxy.start())
        with coord.client(timeout_s=120) as c:
            register(c, "s", "small")
            assert c.call("s", {"x": 1.0}).restore_s > 0.0
            assert c.call("s", {"x": 1.0}).restore_s == 0.0  # resident
            proxy.partition()
            wait_node_state(coord, "far", "lost", HEARTBEAT_TIMEOUT_S + 20)
            proxy.heal()
            wait_node_state(coord, "far", "ready", 30)
            again = c.call("s", {"x": 5.0})
            assert again.outcome == "ok" and again.node == "far", again
            assert again.result is not None and again.result["y"] == want("small", 5.0)
            assert again.restore_s > 0.0, again  # evicted at the rejoin, as the pool knows
    finally:
        proxy.close()
    finish({"coordinator": coord, "far": far})
