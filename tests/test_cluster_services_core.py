"""GPU services in a coordinator's core, as a pure state machine: nodes' GPUs join the gpu
pool (``NodeGpus``), calls are placed on them and sent to their node, and a node lost
takes its calls (``infra_error``) and its residency with it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tangram.model import ActionId
from tangram.pools.cpu import CpuCluster
from tangram.pools.gpu import GPU_STRIDE, GpuCluster, GpuNodePool, ServiceSpec
from tangram.protocol.results import CallSpec
from tangramd import events as ev
from tangramd.cluster.services import ClusterServices
from tangramd.services.spec import ServiceSpec as Registration
from tangramd.state import Core, CoreConfig

GB = 10**9
SMALL = Registration("s", "torch", 0.06, entry="m:f")
OTHER = Registration("t", "torch", 0.06, entry="m:g")


@pytest.fixture(autouse=True)
def validate_after_every_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test checks the core's invariants after each event it feeds."""
    handle = Core.handle

    def checked(self: Core, event: ev.Event, now: float) -> list[ev.Command]:
        out = handle(self, event, now)
        self.validate()
        return out

    monkeypatch.setattr(Core, "handle", checked)


def coordinator_core(*specs: Registration) -> Core:
    """A coordinator's core: no node, an empty gpu pool, ``specs`` registered."""
    core = Core(CpuCluster([]), {}, CoreConfig(record_envs=False), gpu=GpuCluster([], {}))
    core.handle(ev.ServicesRecovered(specs=specs), 0.0)
    return core


def gpus_join(core: Core, node: str, count: int = 1, h2d: float = 1e9) -> list[ev.Command]:
    event = ev.NodeGpus(node=node, count=count, mem_per_gpu=GB // 10, h2d_bytes_per_s=h2d)
    return core.handle(event, 0.0)


def call(core: Core, token: int, name: str = "s", now: float = 0.0) -> list[ev.Command]:
    core.handle(ev.SubmitCall(spec=CallSpec(name, {"x": token}), token=token), now)
    return core.handle(ev.Tick(), now)


# ---------------------------------------------------------------------- the pool


def test_a_gpu_node_keeps_its_slot_and_the_others_keep_their_ids() -> None:
    """Nodes join and leave the gpu pool without changing any other node's global ids;
    a node that comes back takes its old slot, with no residency; a node whose GPUs an
    action holds cannot leave."""
    spec = ServiceSpec("s", GB // 20)
    pool = GpuCluster([], {"s": spec})
    for name in ("a", "b", "c"):
        pool.add_node(GpuNodePool(name, 2, mem_per_gpu=GB, h2d_bytes_per_s=1e9))
    assert pool.locate(GPU_STRIDE + 1) == ("b", 1)
    pool.allocate(ActionId("x"), (2 * GPU_STRIDE,))
    pool.restore_for(ActionId("x"), "s", 1)
    pool.allocate(ActionId("y"), (GPU_STRIDE,))
    with pytest.raises(ValueError, match="hold GPUs"):
        pool.remove_node("b")
    pool.release(ActionId("y"))
    pool.remove_node("b")
    assert [n.node_id for n in pool.nodes] == ["a", "c"] and pool.capacity == 4
    with pytest.raises(ValueError):
        pool.locate(GPU_STRIDE)
    assert pool.held(ActionId("x")) == (2 * GPU_STRIDE,)  # c's ids are as they were
    assert pool.is_resident("s", (2 * GPU_STRIDE,))
    pool.add_node(GpuNodePool("b", 2, mem_per_gpu=GB, h2d_bytes_per_s=1e9))
    assert pool.global_ids("b", (0,)) == (GPU_STRIDE,)
    assert not pool.is_resident("s", (GPU_STRIDE,)) and pool.node("b").backups == {"s"}
    pool.add_node(GpuNodePool("d", 1, mem_per_gpu=GB, h2d_bytes_per_s=1e9))
    assert pool.global_ids("d", (0,)) == (3 * GPU_STRIDE,)
    with pytest.raises(ValueError, match="already"):
        pool.add_node(GpuNodePool("d", 1, mem_per_gpu=GB, h2d_bytes_per_s=1e9))
    pool.validate()


# ---------------------------------------------------------------------- the core


def test_a_call_goes_to_the_node_that_holds_its_gpus() -> None:
    """A call is placed on a joined node's GPUs and sent there with the node's local GPU
    ids and a restore timed at that node's bandwidth (resident nowhere: the node that
    restores it fastest, b, not the first to join); with no node, a registration is
    refused and a call is unschedulable."""
    core = coordinator_core(SMALL)
    (reply,) = core.handle(ev.SubmitCall(spec=CallSpec("s", {}), token=1), 0.0)
    assert reply.error is not None and reply.error[0] == "unschedulable"
    (reply,) = core.handle(ev.RegisterService(args=OTHER.to_json(), token=9), 0.0)
    assert reply.error is not None and "no node with GPUs" in reply.error[1]
    core.handle(ev.NodeLost(node="a"), 0.0)  # never joined: nothing to do
    assert gpus_join(core, "a") == []
    assert gpus_join(core, "b", h2d=2e9) == []
    gpus_join(core, "b", h2d=2e9)  # back within the timeout: as it was
    (run,) = call(core, 2)
    assert isinstance(run, ev.RunCall) and (run.node, run.gpus) == ("b", (0,))
    story = str(core.read.story(run.action_id, 0.0))
    assert "restore onto node=b gpus=[0] est_s=0.03" in story
    assert core.read.call_node(run.action_id) == "b"
    assert core.read.node_work("b")["calls"] == [run.action_id]
    (reply,) = core.handle(
        ev.CallFinished(action_id=run.action_id, outcome="ok", result={"y": 1}), 0.5
    )
    assert reply.result["node"] == "b" and reply.result["gpus"] == [0]


def test_a_lost_node_fails_its_calls_and_its_replicas_leave_the_pool() -> None:
    """Losing a node ends its running calls (``infra_error`` naming it) and drops its
    residency; the other node's call runs on and ends as usual."""
    core = coordinator_core(SMALL)
    gpus_join(core, "a")
    gpus_join(core, "b")
    (first,) = call(core, 1)
    (second,) = call(core, 2, now=0.1)  # the first holds its GPU: the other node's
    assert isinstance(first, ev.RunCall) and isinstance(second, ev.RunCall)
    assert {first.node, second.node} == {"a", "b"}
    out = core.handle(ev.NodeLost(node=second.node, why="missed heartbeats"), 1.0)
    (reply,) = [c for c in out if isinstance(c, ev.Reply)]
    assert reply.token == 2 and reply.result["outcome"] == "infra_error"
    assert f"node {second.node} lost: missed heartbeats" in reply.result["error"]
    assert reply.result["node"] == second.node
    assert [n.node_id for n in core.gpu.nodes] == [first.node]  # type: ignore[union-attr]
    assert core.read.node_work(second.node)["calls"] == []
    # a late call_done of the lost node's call finds nothing to end
    assert core.handle(ev.CallFinished(action_id=second.action_id, outcome="ok"), 1.2) == []
    (done,) = core.handle(ev.CallFinished(action_id=first.action_id, outcome="ok"), 1.5)
    assert isinstance(done, ev.Reply) and done.result["outcome"] == "ok"
    (again,) = call(core, 3, now=2.0)  # resident on the node still there: no restore
    assert isinstance(again, ev.RunCall) and again.node == first.node


def test_a_lost_node_takes_its_open_batch_and_its_warm_replica_moves() -> None:
    """A batch still forming on a lost node is never sent (its calls end ``infra_error``),
    and a ``min_resident`` replica that was on it is warmed again on a node with room."""
    batching = Registration("s", "torch", 0.06, entry="m:f", max_batch=4, batch_window_ms=50.0)
    warm = Registration("w", "torch", 0.03, entry="m:w", min_resident=1)
    core = coordinator_core(batching, warm)
    (warmed,) = gpus_join(core, "a")
    assert isinstance(warmed, ev.WarmService) and warmed.node == "a"
    assert gpus_join(core, "b") == []  # w has its replica
    assert call(core, 1) == []  # a batch opens (its window: 50 ms), on a's GPU or b's
    assert core.handle(ev.SubmitCall(spec=CallSpec("s", {}), token=2), 0.01) == []
    (batch,) = core.services.forming["s"]
    out = core.handle(ev.NodeLost(node=batch.node), 0.02)
    replies = sorted(c.token for c in out if isinstance(c, ev.Reply))
    assert replies == [1, 2] and "s" not in core.services.forming
    assert not [c for c in out if isinstance(c, ev.RunCall)]
    moved = [c for c in out if isinstance(c, ev.WarmService)]
    if batch.node == "a":  # w was there: it is warmed on b
        assert [(m.service, m.node) for m in moved] == [("w", "b")]
    else:
        assert moved == []
    assert core.handle(ev.Tick(), 1.0) == []  # nothing left to send


def test_the_coordinator_keeps_registrations_and_merges_its_nodes_rows(tmp_path: Path) -> None:
    """Registrations outlive the coordinator (services.json; the config's ``[[service]]``
    replace a kept one of the same name); ``service list`` merges the nodes' rows: every
    replica, the counters summed, and a lost node's counters kept without its replicas."""
    kept = ClusterServices(tmp_path)
    kept.recover()
    kept.added(SMALL)
    kept.added(OTHER)
    declared = Registration("t", "torch", 0.05, entry="m:h")
    again = ClusterServices(tmp_path, [declared])
    assert again.recover() == (SMALL, declared)
    replica = {"gpus": [0], "state": "resident", "restores": 1}
    for node, calls in (("a", 3), ("b", 4)):
        row = {"name": "s", "calls": calls, "restores": 1, "warm": 1, "module_bytes": 9}
        again.reported(node, [{**row, "replicas": [{**replica, "node": node}]}])
    failed = {"name": "s", "calls": 4, "restores": 1, "warm": 1, "error": "boom"}
    again.reported("b", [{**failed, "replicas": [{**replica, "node": "b"}]}])
    (s, t) = again.list()
    assert (s["calls"], s["restores"], s["warm"], s["module_bytes"]) == (7, 2, 2, 9)
    assert [r["node"] for r in s["replicas"]] == ["a", "b"] and s["error"] == "node b: boom"
    assert t["replicas"] == [] and t["calls"] == 0 and t["mem_gb"] == 0.05
    again.node_gone("b")
    (s, _) = again.list()
    assert (s["calls"], s["warm"], [r["node"] for r in s["replicas"]]) == (7, 1, ["a"])
    again.removed("t")
    assert [spec.name for spec in ClusterServices(tmp_path).recover()] == ["s"]


def test_a_hosts_rows_and_the_coordinators_merged_rows_share_the_specs_fields(
    tmp_path: Path,
) -> None:
    """``ServiceSpec.list_fields`` is the spec's part of a ``service list`` row, on a host
    (``ServiceHost.list``) and on the coordinator (merged from the nodes' rows): the same
    fields, the same keys in all."""
    from tangramd.services.host import Hosted, ServiceHost
    from tangramd.services.inventory import SimulatedGpus, discover

    spec = Registration("e", "torch", 0.05, gpus=(1, 2), entry="m:h", eff={2: 1.8}, max_batch=4)
    fields = spec.list_fields()
    assert fields["eff"] == "2:1.8" and fields["max_batch"] == 4 and fields["gpus"] == [1, 2]
    host = ServiceHost(discover(SimulatedGpus(1, 1.0, 50.0), use_nvml=False), tmp_path / "h")
    host._services[spec.name] = Hosted(spec)  # (a registration without its fork server)
    (row,) = host.list()
    services = ClusterServices(tmp_path / "c")
    services.recover()
    services.added(spec)
    services.reported("a", [row])
    (merged,) = services.list()
    assert {k: row[k] for k in fields} == fields == {k: merged[k] for k in fields}
    assert list(row) == list(merged)


def test_cancel_of_a_running_call_holds_its_gpu_until_the_stop_is_confirmed() -> None:
    """`cancel --job --all` with a call running on the node's one GPU and another waiting:
    the waiting one ends cancelled now, the running one gets a ``StopCall`` to its node
    and keeps the GPU (a third call is not placed) until its ``CallFinished`` comes back;
    then it ends cancelled, the job cancel answers both, and the GPU goes to the third."""
    core = coordinator_core(SMALL)
    gpus_join(core, "a")
    (run,) = [c for c in call(core, 1) if isinstance(c, ev.RunCall)]
    assert not [c for c in call(core, 2) if isinstance(c, ev.RunCall)]
    (waiting,) = core.actions.queue
    out = core.handle(ev.CancelAction(token=9, job="default", everyone=True), 0.1)
    stops = [c for c in out if isinstance(c, ev.StopCall)]
    assert stops == [ev.StopCall(action_id=run.action_id, node="a", cause=stops[0].cause)]
    assert {c.token for c in out if isinstance(c, ev.Reply)} == {2}  # the waiting call
    assert not [c for c in call(core, 3, now=0.2) if isinstance(c, ev.RunCall)]  # GPU held
    done = ev.CallFinished(run.action_id, outcome="infra_error", error="stopped")
    out = core.handle(done, 0.3) + core.handle(ev.Tick(), 0.3)
    answers = {c.token: c for c in out if isinstance(c, ev.Reply)}
    assert answers[1].result is not None and answers[1].result["outcome"] == "cancelled"
    rows = {r["action_id"]: r for r in (answers[9].result or {})["actions"]}
    assert rows[run.action_id]["outcome"] == "cancelled", rows
    assert rows[waiting]["outcome"] == "cancelled", rows
    (nxt,) = [c for c in out if isinstance(c, ev.RunCall)]
    assert nxt.node == "a" and nxt.gpus == (0,), nxt
