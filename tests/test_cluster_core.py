"""The core's cluster events as a pure state machine: nodes join, get lost, drain."""

from __future__ import annotations

import re

import pytest

from tangram.model import TangramError
from tangram.pools.cpu import CpuCluster
from tangram.protocol.results import ExecResult, ExecSpec
from tangramd import events as ev
from tangramd.state import Core, CoreConfig

GIB = 1 << 30


@pytest.fixture(autouse=True)
def validate_after_every_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test checks the core's invariants after each event it feeds."""
    handle = Core.handle

    def checked(self: Core, event: ev.Event, now: float) -> list[ev.Command]:
        out = handle(self, event, now)
        self.validate()
        self.cpu.validate()
        return out

    monkeypatch.setattr(Core, "handle", checked)


def cluster_core() -> Core:
    """A coordinator's core: no node until one joins."""
    return Core(CpuCluster([]), {}, CoreConfig(record_envs=False))


def join(core: Core, name: str, cores: tuple[int, ...] = (0, 1), mem: int = 8 * GIB) -> None:
    assert core.handle(ev.NodeJoined(node=name, cores_by_numa=(cores,), mem_bytes=mem), 0) == []


def open_ready(core: Core, token: int, now: float = 0.0) -> ev.CreateEnv:
    (create,) = core.handle(ev.OpenEnv(token=token), now)
    assert isinstance(create, ev.CreateEnv)
    (reply,) = core.handle(ev.EnvCreated(env_id=create.env_id), now)
    assert reply.result == {"id": create.env_id, "node": create.node}
    return create


def run(core: Core, token: int, env: str, now: float) -> ev.RunExec:
    assert core.handle(ev.SubmitExec(spec=ExecSpec(cmd="sleep 9", env=env), token=token), now) == []
    (run_cmd,) = core.handle(ev.Tick(), now + 0.01)
    assert isinstance(run_cmd, ev.RunExec)
    return run_cmd


def test_without_nodes_an_environment_is_unschedulable() -> None:
    """A coordinator with no node answers env.open with unschedulable, not a crash."""
    core = cluster_core()
    (reply,) = core.handle(ev.OpenEnv(token=1), 0)
    assert reply.error is not None and reply.error[0] == "unschedulable"


def test_environments_spread_over_joined_nodes_by_memory() -> None:
    """Two joined nodes: the second environment goes to the emptier node."""
    core = cluster_core()
    join(core, "a")
    join(core, "b")
    assert {open_ready(core, 1).node, open_ready(core, 2).node} == {"a", "b"}
    assert [row["name"] for row in core.read.node_rows()] == ["a", "b"]


def test_rejoin_of_a_known_node_keeps_its_pool() -> None:
    """A node whose link came back within the timeout keeps its running work (and the
    kills a cancel still waits for)."""
    core = cluster_core()
    join(core, "a")
    create = open_ready(core, 1)
    running = run(core, 2, create.env_id, 1.0)
    join(core, "a")
    assert core.read.action_node(running.action_id) == "a"
    assert core.read.node_work("a") == {
        "keep": [create.env_id],
        "creating": [],
        "closing": [],
        "running": [running.action_id],
        "killing": [],
        "calls": [],
    }
    # a cancel is killing it: a rejoin sends the kill again (it may have been lost)
    kill = [c for c in core.handle(ev.CancelAction(action_id=running.action_id), 2.0)]
    assert [type(c) for c in kill] == [ev.KillExec]
    join(core, "a")
    assert core.read.node_work("a")["killing"] == [
        {"action_id": running.action_id, "session": None}
    ]


def test_lost_node_ends_its_actions_and_loses_its_environments() -> None:
    """NodeLost: the running action is answered infra_error naming the node, the env
    refuses the next action with env_lost, the pool leaves, the other node stays."""
    core = cluster_core()
    join(core, "a")
    join(core, "b")
    env_a = open_ready(core, 1)
    env_b = open_ready(core, 2)
    lost = env_a if env_a.node == "a" else env_b
    kept = env_b if lost is env_a else env_a
    running = run(core, 3, lost.env_id, 1.0)
    out = core.handle(ev.NodeLost(node=lost.node, why="missed heartbeats"), 2.0)
    (reply,) = [c for c in out if isinstance(c, ev.Reply)]
    assert reply.token == 3 and reply.result["outcome"] == "infra_error"
    assert reply.result["detail"] == f"node {lost.node} lost: missed heartbeats"
    assert reply.result["node"] == lost.node and reply.result["action_id"] == running.action_id
    assert [row["name"] for row in core.read.node_rows()] == [kept.node]
    (refused,) = core.handle(ev.SubmitExec(spec=ExecSpec(cmd="true", env=lost.env_id), token=4), 3)
    assert refused.error == (
        "env_lost",
        f"environment {lost.env_id} was lost with node {lost.node}; open a new one",
    )
    # a late outcome of the ended action is ignored
    late = ev.ExecFinished(running.action_id, ExecResult("ok", exit_code=0))
    assert core.handle(late, 4) == []
    # closing the lost environment still works (the coordinator answers for the gone node)
    (remove,) = core.handle(ev.CloseEnv(token=5, env_id=lost.env_id), 5)
    assert isinstance(remove, ev.RemoveEnv) and remove.node == lost.node
    (closed,) = core.handle(ev.EnvRemoved(env_id=lost.env_id), 5)
    assert closed.result == {"closed": True}


def test_lost_node_fails_an_environment_being_created() -> None:
    """env.open waiting for a node that is then lost gets infra_error, not silence."""
    core = cluster_core()
    join(core, "a")
    (create,) = core.handle(ev.OpenEnv(token=1), 0)
    out = core.handle(ev.NodeLost(node="a", why="link closed"), 1)
    replies = [c for c in out if isinstance(c, ev.Reply)]
    expected = [(1, ("infra_error", "node a lost: link closed"))]
    assert [(r.token, r.error) for r in replies] == expected
    assert [type(c) for c in out if not isinstance(c, ev.Reply)] == [ev.RemoveEnv]
    assert core.handle(ev.EnvRemoved(env_id=create.env_id), 1) == []
    assert core.read.env_ids() == []


def test_throwaway_exec_on_a_lost_node_is_answered_and_its_env_closed() -> None:
    """A queued throwaway exec whose node is lost ends infra_error; its env is closed."""
    core = cluster_core()
    join(core, "a", cores=(0,))
    env = open_ready(core, 1)
    run(core, 2, env.env_id, 0.5)  # holds the only core: the next one stays queued
    (create,) = core.handle(ev.SubmitExec(spec=ExecSpec(cmd="true"), token=3), 1)
    core.handle(ev.EnvCreated(env_id=create.env_id), 1)
    out = core.handle(ev.NodeLost(node="a"), 2)
    answered = sorted(c.token for c in out if isinstance(c, ev.Reply))
    assert answered == [2, 3]
    assert {c.env_id for c in out if isinstance(c, ev.RemoveEnv)} == {create.env_id}


def test_drained_node_takes_no_new_trajectories() -> None:
    """DrainNode: new environments go to the other node; undrain restores it."""
    core = cluster_core()
    join(core, "a")
    join(core, "b")
    (reply,) = core.handle(ev.DrainNode(node="a", drain=True, token=1), 0)
    assert reply.result == {"name": "a", "draining": True}
    assert {open_ready(core, t).node for t in (2, 3, 4)} == {"b"}
    states = {row["name"]: row["state"] for row in core.read.node_rows()}
    assert states == {"a": "draining", "b": "ready"}
    core.handle(ev.DrainNode(node="a", drain=False), 1)
    assert open_ready(core, 5).node == "a"


def test_draining_an_unknown_node_is_not_found() -> None:
    """node.drain of a node that never joined (or was lost) is a typed not_found."""
    core = cluster_core()
    (reply,) = core.handle(ev.DrainNode(node="ghost", token=1), 0)
    assert reply.error is not None and reply.error[0] == "not_found"
    with pytest.raises(TangramError):
        core.handle(ev.DrainNode(node="ghost"), 0)


def test_restored_environments_wait_for_their_node() -> None:
    """After a coordinator restart an environment answers a retryable infra_error until its
    node rejoins, then runs there; new ids do not collide with restored ones."""
    core = cluster_core()
    row = {"id": "e7", "trajectory": "t", "node": "a", "image": None, "mem": GIB, "lost_node": ""}
    gone = {**row, "id": "e3", "trajectory": "u", "node": "b", "lost_node": "b"}
    assert core.handle(ev.EnvsRestored(envs=(row, gone)), 0) == []
    (early,) = core.handle(ev.SubmitExec(spec=ExecSpec(cmd="true", env="e7"), token=1), 0)
    assert early.error is not None and early.error[0] == "infra_error"
    join(core, "a")
    running = run(core, 2, "e7", 1.0)
    assert (running.node, running.env_id) == ("a", "e7")
    (lost,) = core.handle(ev.SubmitExec(spec=ExecSpec(cmd="true", env="e3"), token=3), 1)
    assert lost.error is not None and lost.error[0] == "env_lost"
    fresh = open_ready(core, 4).env_id
    assert fresh not in ("e7", "e3") and re.fullmatch(r"e[0-9a-f]{32}", fresh), fresh


def test_queued_throwaway_work_of_a_lost_node_moves_to_another() -> None:
    """A throwaway exec queued on a node that is lost is not failed: its environment is
    created afresh on the other node and it runs there."""
    core = cluster_core()
    join(core, "a", cores=(0,))
    join(core, "b", cores=(0,))
    env = open_ready(core, 1)  # the persistent env decides which node is busier
    busy = env.node
    run(core, 2, env.env_id, 0.5)  # holds the busy node's only core
    core.handle(ev.DrainNode(node="b" if busy == "a" else "a"), 0.6)  # send the next to busy
    (create,) = core.handle(ev.SubmitExec(spec=ExecSpec(cmd="true"), token=3), 1)
    assert create.node == busy
    core.handle(ev.DrainNode(node="b" if busy == "a" else "a", drain=False), 1)
    assert core.handle(ev.EnvCreated(env_id=create.env_id), 1) == []
    assert core.handle(ev.Tick(), 1.01) == []  # queued: the only core there is held
    out = core.handle(ev.NodeLost(node=busy), 2)
    (moved,) = [c for c in out if isinstance(c, ev.CreateEnv)]
    assert moved.env_id == create.env_id and moved.node != busy
    assert [c.token for c in out if isinstance(c, ev.Reply)] == [2]  # only the running one
    assert core.handle(ev.EnvCreated(env_id=moved.env_id), 2) == []
    (run_cmd,) = core.handle(ev.Tick(), 2.01)
    assert isinstance(run_cmd, ev.RunExec) and run_cmd.node == moved.node
    story = core.read.story(run_cmd.action_id, 0)["events"]
    assert any("moving to another node" in entry["detail"] for entry in story)


def test_the_same_core_id_on_two_nodes_is_two_cores() -> None:
    """Core 0 of node a and core 0 of node b run two actions at once; validate() agrees."""
    core = cluster_core()
    join(core, "a", cores=(0,))
    join(core, "b", cores=(0,))
    first, second = open_ready(core, 1), open_ready(core, 2)
    assert {first.node, second.node} == {"a", "b"}
    runs = [run(core, 10, first.env_id, 1.0), run(core, 11, second.env_id, 2.0)]
    assert [r.cores for r in runs] == [(0,), (0,)] and {r.node for r in runs} == {"a", "b"}
    core.validate()


@pytest.mark.parametrize(
    "gpus",
    [
        "8",
        [1],
        [{"mem_bytes": -1, "h2d_bytes_per_s": 1.0}],
        [{"mem_bytes": 1, "h2d_bytes_per_s": 0}],
        [{"mem_bytes": True, "h2d_bytes_per_s": 1.0}],
        [{"mem_bytes": 1, "h2d_bytes_per_s": 1.0}] * 65,
    ],
)
def test_a_hello_with_malformed_gpus_is_refused(gpus: object) -> None:
    from tangramd.cluster.coordinator import _parse_gpus
    from tangramd.cluster.registry import Refused

    with pytest.raises(Refused, match="gpus"):
        _parse_gpus(gpus)


def test_a_hellos_gpus_are_kept_as_reported() -> None:
    from tangramd.cluster.coordinator import _parse_gpus

    hello = [{"name": "H200" * 20, "mem_bytes": 1 << 30, "h2d_bytes_per_s": 25e9, "x": 1}]
    assert _parse_gpus(hello) == (
        {
            "local": 0,
            "name": ("H200" * 20)[:64],
            "mem_bytes": 1 << 30,
            "h2d_bytes_per_s": 25e9,
            "simulated": False,
        },
    )
    assert _parse_gpus(None) == ()


def test_environment_ids_are_128_random_bits() -> None:
    """Environment ids are ``e`` and 32 random hex digits (128 bits): no caller can reach
    another's environment by counting (issue 30, item 4)."""
    core = cluster_core()
    join(core, "a")
    ids = [open_ready(core, token).env_id for token in range(1, 9)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"e[0-9a-f]{32}", i) for i in ids), ids
    digits = {int(i[1:], 16) for i in ids}
    assert max(abs(a - b) for a in digits for b in digits) > 1 << 64
