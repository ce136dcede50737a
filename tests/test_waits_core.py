"""The core's bounded waits, driven event by event (no daemon, no clock): the deadlines the
core asks to be woken for, what a wait past its deadline ends with, how much of its timeout
a command that waited gets, and what a client's leaving withdraws (issue 35, items 4, 5).

A node with 2 GiB and environments of 1 GiB: two open environments take all the memory.
"""

from __future__ import annotations

import pytest

from tangram.pools.cpu import CpuCluster, CpuNodePool
from tangram.protocol.results import ExecResult, ExecSpec
from tangramd import events as ev
from tangramd.state import Core, CoreConfig

GIB = 1 << 30
NO_MEM = "memory: needs 1 GiB, 0 GiB free"


@pytest.fixture(autouse=True)
def validate_after_every_event(monkeypatch: pytest.MonkeyPatch) -> None:
    handle = Core.handle

    def checked(self: Core, event: ev.Event, now: float) -> list[ev.Command]:
        out = handle(self, event, now)
        self.validate()
        return out

    monkeypatch.setattr(Core, "handle", checked)


def make_core(cores: int = 2) -> Core:
    return Core(CpuCluster([CpuNodePool("local", [list(range(cores))], 2 * GIB)]), {}, CoreConfig())


def open_env(core: Core, token: int, now: float = 0.0) -> str:
    (create,) = core.handle(ev.OpenEnv(token=token, conn=1), now)
    assert isinstance(create, ev.CreateEnv)
    core.handle(ev.EnvCreated(env_id=create.env_id), now)
    return create.env_id


def full_core() -> tuple[Core, list[str]]:
    core = make_core()
    return core, [open_env(core, 1), open_env(core, 2)]


def replies(out: list[ev.Command]) -> list[ev.Reply]:
    return [c for c in out if isinstance(c, ev.Reply)]


def test_a_wait_for_memory_ends_at_its_timeout_naming_the_memory():
    core, _ = full_core()
    assert core.handle(ev.SubmitExec(ExecSpec(cmd="true", timeout_s=2.0), token=9), 1.0) == []
    assert core.next_wakeup(1.0) == 3.0  # woken at the deadline, not later
    status = core.read.status(1.5)
    assert (status["queued"], status["waiting_env"], status["waiting_mem"]) == (0, 1, 1)
    assert status["mem_wait"] == NO_MEM
    assert core.read.queue_view(1.5)["waiting"][0]["deadline_s"] == pytest.approx(1.5)
    assert core.handle(ev.Tick(), 2.9) == []
    out = core.handle(ev.Tick(), 3.0)
    (reply,) = replies(out)
    assert reply.token == 9 and reply.result["outcome"] == "timeout"
    assert reply.result["detail"] == f"waited 2.0 s for {NO_MEM}"
    assert reply.result["exec_s"] == 0.0
    assert any(isinstance(c, ev.RemoveEnv) for c in out)  # its throwaway env goes too
    assert core.read.status(3.0)["waiting_mem"] == 0
    assert core.next_wakeup(3.0) is None or core.next_wakeup(3.0) > 3.0


def test_a_command_that_waited_runs_for_what_its_timeout_left():
    """timeout_s bounds waiting plus running; with queue_timeout_s the run gets all of it."""
    core, envs = full_core()
    core.handle(ev.SubmitExec(ExecSpec(cmd="true", timeout_s=10.0), token=9), 0.0)
    core.handle(ev.SubmitExec(ExecSpec(cmd="true", timeout_s=10.0, queue_timeout_s=5.0)), 0.0)
    out: list[ev.Command] = []
    for env in envs:  # memory for both of them
        core.handle(ev.CloseEnv(token=3, env_id=env), 4.0)
        out += core.handle(ev.EnvRemoved(env_id=env), 4.0)
    creates = [c for c in out if isinstance(c, ev.CreateEnv)]
    for create in creates:
        core.handle(ev.EnvCreated(env_id=create.env_id), 4.0)
    runs = [c for c in core.handle(ev.Tick(), 4.0) if isinstance(c, ev.RunExec)]
    assert sorted(r.spec.timeout_s for r in runs) == [6.0, 10.0]


def test_a_wait_for_cores_names_the_cores():
    core = make_core(cores=1)
    env = open_env(core, 1)
    core.handle(ev.SubmitExec(ExecSpec(cmd="a", env=env)), 0.0)
    (run,) = [c for c in core.handle(ev.Tick(), 0.0) if isinstance(c, ev.RunExec)]
    core.handle(ev.SubmitExec(ExecSpec(cmd="b", env=env, queue_timeout_s=1.0), token=9), 0.0)
    assert core.read.queue_view(0.5)["waiting"][0]["waiting_for"] == (
        "cores: needs 1, 0 free on local"
    )
    (reply,) = replies(core.handle(ev.Tick(), 1.0))
    assert reply.result["outcome"] == "timeout"
    assert reply.result["detail"] == "waited 1.0 s for cores: needs 1, 0 free on local"
    core.handle(ev.ExecFinished(run.action_id, ExecResult("ok", exit_code=0)), 1.5)


def test_env_open_timeout_is_a_typed_error_and_frees_the_wait():
    core, _ = full_core()
    assert core.handle(ev.OpenEnv(token=5, timeout_s=0.5, conn=2), 0.0) == []
    assert core.next_wakeup(0.0) == 0.5
    out = core.handle(ev.Tick(), 0.5)
    (reply,) = replies(out)
    assert reply.error == ("timeout", f"waited 0.5 s for {NO_MEM}")
    assert core.read.queue_view(0.5)["envs"] == []


def test_a_client_that_leaves_withdraws_its_waits():
    """Its exec waiting for memory ends rejected (never runs) and its env.open waiting for
    memory is closed; its ready environments stay."""
    core, envs = full_core()
    core.handle(ev.SubmitExec(ExecSpec(cmd="touch x"), token=9, conn=7), 0.0)
    core.handle(ev.OpenEnv(token=10, conn=7), 0.0)
    assert core.read.status(0.0)["waiting_mem"] == 2
    core.handle(ev.ConnClosed(conn=7), 1.0)
    assert core.read.status(1.0)["waiting_mem"] == 0
    assert core.read.status(1.0)["waiting_env"] == 0
    core.handle(ev.ConnClosed(conn=1), 1.0)  # the opener of the ready ones: they stay
    assert {row["id"] for row in core.read.env_rows(1.0) if row["state"] == "ready"} == set(envs)
