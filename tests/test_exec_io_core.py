"""The core's env.put / env.get and session events, synchronously: events in, commands out."""

from __future__ import annotations

import pytest
from test_core import acting, make_core, ready_env, submit, tick, validate_after_every_event

from tangram.protocol.results import ExecResult
from tangramd import events as ev

__all__ = ["validate_after_every_event"]  # the autouse invariant check applies here too


def test_transfers_become_commands_and_replies():
    """env.put / env.get become RunTransfer; its outcome comes back as the reply."""
    core = make_core()
    env = ready_env(core)
    (put,) = core.handle(ev.PutFile(token=5, env_id=env, path="a", data=b"x"), 1.0)
    assert isinstance(put, ev.RunTransfer) and (put.direction, put.data) == ("put", b"x")
    (get,) = core.handle(ev.GetFile(token=6, env_id=env, path="a"), 1.0)
    assert get.direction == "get" and get.max_bytes == core.cfg.max_transfer
    (reply,) = core.handle(ev.TransferDone(token=6, env_id=env, result={"data": b"x"}), 1.1)
    assert isinstance(reply, ev.Reply) and reply.result == {"data": b"x"}
    (refused,) = core.handle(ev.GetFile(token=7, env_id="nope", path="a"), 1.2)
    assert refused.error is not None and refused.error[0] == "not_found"


def test_session_runs_are_actions_one_at_a_time():
    """A session run is queued, placed and replied like any exec; a second waits its turn."""
    core = make_core()
    env = ready_env(core)
    (start,) = core.handle(ev.OpenSession(token=2, env_id=env), 0.5)
    assert isinstance(start, ev.StartShell)
    (opened,) = core.handle(ev.SessionOpened(session_id=start.session_id), 0.6)
    sid = opened.result["id"]
    assert core.handle(submit(3, "cd /tmp", session=sid), 1.0) == []
    (run,) = tick(core, 1.0)
    assert isinstance(run, ev.RunExec) and run.spec.session == sid and run.env_id == env
    (busy,) = core.handle(submit(4, "true", session=sid), 1.1)
    assert busy.error is not None and "busy" in busy.error[1]
    (interrupt, answer) = core.handle(ev.InterruptSession(token=8, session_id=sid), 1.2)
    assert isinstance(interrupt, ev.InterruptShell) and answer.result == {"interrupted": True}
    done = ExecResult("failed", exit_code=130)
    (reply,) = acting(core.handle(ev.ExecFinished(action_id=run.action_id, result=done), 1.3))
    assert reply.token == 3 and reply.result["exit_code"] == 130
    assert core.handle(submit(9, "true", session=sid), 1.4) == []  # free again


def test_session_close_and_environment_removal():
    """session.close ends the shell; removing the environment forgets its sessions."""
    core = make_core()
    env = ready_env(core)
    sids = []
    for token in (2, 3):
        (start,) = core.handle(ev.OpenSession(token=token, env_id=env), 0.5)
        core.handle(ev.SessionOpened(session_id=start.session_id), 0.6)
        sids.append(start.session_id)
    (end,) = core.handle(ev.CloseSession(token=4, session_id=sids[0]), 1.0)
    assert isinstance(end, ev.EndShell)
    (closed,) = core.handle(ev.SessionClosed(session_id=sids[0]), 1.1)
    assert closed.result == {"closed": True}
    (remove,) = acting(core.handle(ev.CloseEnv(token=5, env_id=env), 1.2))
    assert isinstance(remove, ev.RemoveEnv)
    core.handle(ev.EnvRemoved(env_id=env), 1.3)
    assert core.read.session_rows() == []
    (gone,) = core.handle(submit(6, "true", session=sids[1]), 1.4)
    assert gone.error is not None and gone.error[0] == "not_found"


def test_failed_shell_start_is_an_infra_error():
    """A shell the backend could not start answers session.open with infra_error."""
    core = make_core()
    env = ready_env(core)
    (start,) = core.handle(ev.OpenSession(token=2, env_id=env), 0.5)
    (reply,) = core.handle(ev.SessionOpened(session_id=start.session_id, error="boom"), 0.6)
    assert reply.error == ("infra_error", "boom")
    with pytest.raises(KeyError):
        core.sessions[start.session_id]
