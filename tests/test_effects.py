"""The effects back ends on their own: what RemoteEffects sends and reports when a node
cannot be reached or an exec's input is not where it runs (LocalEffects is exercised by
every daemon test: tangramd up and the nodes run on it)."""

from __future__ import annotations

import asyncio
from typing import Any

from tangram.protocol.results import ExecSpec
from tangram.testing import wait_for_async
from tangramd import events as ev
from tangramd.run.remote import OnNode, PutOnNode, RemoteEffects


def _remote(sent: list[tuple[str, dict[str, Any]]], on_node: OnNode, up: bool = True):
    reported: list[ev.Event] = []

    def send(node: str, msg: dict[str, Any]) -> bool:
        sent.append((node, msg))
        return up

    effects = RemoteEffects(send, lambda cmd: on_node, lambda cmd: (None, None))
    effects.bind(reported.append, lambda coro: None)
    return effects, reported


def _run(effects: RemoteEffects, cmd: ev.Command) -> None:
    async def go() -> None:
        getattr(effects, {ev.RunExec: "run_exec", ev.CreateEnv: "create_env"}[type(cmd)])(cmd)
        await asyncio.sleep(0)  # failures are reported on the next turn, never inside feed

    asyncio.run(go())


RUN = ev.RunExec(
    action_id="a1",
    env_id="e1",
    node="a",
    cores=(0,),
    spec=ExecSpec(cmd="cat", env="e1", stdin=b"in"),
    max_output=1024,
)


def test_an_exec_whose_input_stayed_on_another_node_never_runs() -> None:
    """A placement whose stdin and files the coordinator never had (req's withheld) and
    that is not on their node ends infra_error, and nothing is sent to a node."""
    sent: list[tuple[str, dict[str, Any]]] = []
    effects, reported = _remote(sent, OnNode(missing="its input stayed on node b"))
    _run(effects, RUN)
    assert sent == []
    (done,) = reported
    assert isinstance(done, ev.ExecFinished) and done.result.outcome == "infra_error"
    assert "stayed on node b" in done.result.detail


def test_a_held_input_is_left_out_of_the_run_exec() -> None:
    """A placement on the node that holds the exec's input sends the spec without it."""
    sent: list[tuple[str, dict[str, Any]]] = []
    effects, reported = _remote(sent, OnNode({"id": 7, "queue_s": 0.0}, held=True))
    _run(effects, RUN)
    ((node, msg),) = sent
    assert node == "a" and msg["held"] is True and "stdin" not in msg["spec"]
    assert msg["reply"] == {"id": 7, "queue_s": 0.0} and reported == []


def test_an_unreachable_node_fails_the_command_on_the_next_turn() -> None:
    """A node that is not connected: the command fails as its outcome event would."""
    sent: list[tuple[str, dict[str, Any]]] = []
    effects, reported = _remote(sent, OnNode(), up=False)
    _run(effects, ev.CreateEnv(env_id="e2", node="b", image=None, mem=1 << 20))
    (created,) = reported
    assert isinstance(created, ev.EnvCreated) and created.error == "node b is not connected"


def test_the_executor_keeps_no_placement_for_execs_another_host_runs(tmp_path) -> None:
    """A coordinator's executor (remote effects) hands each placement on and keeps nothing
    of it: the node reports and logs the end, so a record kept here would never be freed."""
    from tangram.pools.cpu import CpuCluster
    from tangramd import ops
    from tangramd.executor import Executor
    from tangramd.state import Core

    sent: list[tuple[str, dict[str, Any]]] = []
    effects, _ = _remote(sent, OnNode())
    ex = Executor(
        Core(CpuCluster([]), {}),
        effects,
        str(tmp_path / "s.sock"),
        state_dir=str(tmp_path),
        handlers=ops,  # type: ignore[arg-type]
    )

    async def place() -> None:  # (on a loop: the run_exec's deadline is armed on it)
        ex._commands[ev.RunExec](RUN)

    asyncio.run(place())
    assert [msg["t"] for _, msg in sent] == ["run_exec"]
    assert ex._placed == {}


class _Recorded:
    """A coordinator's ``RemoteEffects`` whose link, reports and node verdicts are lists."""

    def __init__(self, request_timeout_s: float, restore_timeout_s: float) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.reported: list[ev.Event] = []
        self.overdue: list[str] = []
        self.lost: list[tuple[str, str]] = []
        self.effects = RemoteEffects(
            self._send,
            lambda cmd: OnNode(),
            lambda cmd: PutOnNode(),
            request_timeout_s=request_timeout_s,
            restore_timeout_s=restore_timeout_s,
            overdue=lambda node, why: self.overdue.append(node),
            lost=lambda node, why: self.lost.append((node, why)),
        )
        self.effects.bind(self.reported.append, lambda coro: None)

    def _send(self, node: str, msg: dict[str, Any]) -> bool:
        self.sent.append((node, msg))
        return True


def test_a_call_batch_the_node_never_answers_fails_each_call_left() -> None:
    """A run_call with riders: each call owes its call_done within the call's timeout plus
    [gpu] restore_timeout_s plus the request grace; the one answered in time is not
    failed, the others end infra_error naming the node (riders first, then the call that
    holds the GPUs), and the node is reported overdue."""
    rec = _Recorded(request_timeout_s=0.05, restore_timeout_s=0.05)
    sent, reported, overdue, effects = rec.sent, rec.reported, rec.overdue, rec.effects
    cmd = ev.RunCall(
        action_id="c1",
        service="s",
        node="a",
        gpus=(0,),
        evicted=(),
        payload={},
        timeout_s=0.05,
        riders=(("r1", {}), ("r2", {})),
    )

    async def go() -> None:
        effects.run_call(cmd)
        assert effects.answered("cl:r2")  # r2's call_done came in time
        # past the deadline: the node is told to stop them
        await wait_for_async(lambda: len(sent) >= 3, 30, "the two stop_calls sent")
        assert reported == [] and effects.stopping("r1") and effects.stopping("c1")
        effects.call_stopped("r1")  # the node confirms (call_stopped): each ends now
        effects.call_stopped("c1")

    asyncio.run(asyncio.wait_for(go(), 30))
    assert [(m["t"], m.get("action_id")) for _, m in sent] == [
        ("run_call", "c1"),
        ("stop_call", "r1"),
        ("stop_call", "c1"),
    ]
    assert [getattr(e, "action_id", None) for e in reported] == ["r1", "c1"]
    for done in reported:
        assert isinstance(done, ev.CallFinished) and done.outcome == "infra_error"
        assert f"node a did not answer run_call for call {done.action_id}" in (done.error or "")
    assert set(overdue) == {"a"}
    assert not effects.answered("cl:c1")  # a late answer finds nothing owed


def test_a_call_whose_stop_the_node_never_confirms_loses_the_node() -> None:
    """Past its deadline a call is told to stop; a node that does not confirm within the
    request grace is reported lost (the coordinator's NodeLost ends the call and frees its
    GPUs), and nothing ends the call before that."""
    rec = _Recorded(request_timeout_s=0.05, restore_timeout_s=0.05)
    sent, reported, lost, effects = rec.sent, rec.reported, rec.lost, rec.effects
    cmd = ev.RunCall(
        action_id="c1", service="s", node="a", gpus=(0,), evicted=(), payload={}, timeout_s=0.05
    )

    async def go() -> None:
        effects.run_call(cmd)
        await wait_for_async(lambda: lost, 30, "the node reported lost")

    asyncio.run(asyncio.wait_for(go(), 30))
    assert [m["t"] for _, m in sent] == ["run_call", "stop_call"]
    assert reported == []
    assert lost == [("a", "node a did not confirm stop_call for call c1 within 0.05 s")]
    assert not effects.stopping("c1")
    effects.call_stopped("c1")  # a confirmation after that ends nothing more
    assert reported == []


def test_a_cancelled_call_is_stopped_on_its_node_and_its_deadline_is_dropped() -> None:
    """``StopCall`` (a cancel of a running call) sends ``stop_call`` at once and drops the
    call's run deadline (its node is not suspect for it); the node's ``call_stopped``
    ends the call (one ``CallFinished``, which the core ends cancelled); a second
    StopCall sends nothing more, and nothing reports the node lost."""
    rec = _Recorded(request_timeout_s=5.0, restore_timeout_s=0.01)
    sent, reported, lost, effects = rec.sent, rec.reported, rec.lost, rec.effects
    run = ev.RunCall(
        action_id="c1", service="s", node="a", gpus=(0,), evicted=(), payload={}, timeout_s=0.01
    )

    async def go() -> None:
        effects.run_call(run)
        effects.stop_running_call(ev.StopCall(action_id="c1", node="a"))
        effects.stop_running_call(ev.StopCall(action_id="c1", node="a"))
        assert not effects.answered("cl:c1")  # its run deadline is gone
        assert effects.stopping("c1")
        effects.call_stopped("c1")

    asyncio.run(asyncio.wait_for(go(), 30))
    assert [(n, m["t"], m.get("action_id")) for n, m in sent] == [
        ("a", "run_call", "c1"),
        ("a", "stop_call", "c1"),
    ]
    (done,) = reported
    assert isinstance(done, ev.CallFinished) and done.action_id == "c1", done
    assert done.error is not None and done.error.startswith("cancelled"), done
    assert lost == [] and not effects.stopping("c1")


def test_an_exec_a_rejoined_node_lost_track_of_owes_nothing_more() -> None:
    """A node back after a drop shorter than the timeout that neither runs an exec nor
    holds its outcome: the coordinator's resume ends it ``infra_error`` and drops its
    deadline too (as it does for a call), so the node is never drained as suspect for an
    exec that has already ended."""
    from tangramd.cluster.coordinator import CoordinatorExecutor

    rec = _Recorded(request_timeout_s=0.05, restore_timeout_s=0.05)
    fed: list[ev.Event] = []
    coordinator: Any = type("Stub", (), {})()
    coordinator.remote, coordinator.feed, coordinator._send = rec.effects, fed.append, rec._send
    hello = {"envs": ["e1"], "running": [], "outbox": []}
    work = {"creating": [], "closing": [], "running": ["a1"], "calls": [], "killing": []}

    async def go() -> None:
        rec.effects.run_exec(RUN)  # the run_exec went out; then the link dropped
        CoordinatorExecutor._resume_inflight(coordinator, "a", hello, work)
        await asyncio.sleep(0.3)  # well past the run_exec's deadline

    asyncio.run(asyncio.wait_for(go(), 30))
    (done,) = fed
    assert isinstance(done, ev.ExecFinished) and done.result.outcome == "infra_error"
    assert "node a lost track of the action" in (done.result.detail or "")
    assert rec.overdue == [], "the node was drained as suspect for an exec already ended"
    assert rec.reported == [] and [m["t"] for _, m in rec.sent] == ["run_exec"]
    assert not rec.effects.answered("x:a1")  # nothing owed
