"""Environments: open, close, created, removed, recovered, and file transfers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tangram.protocol.errors import BadRequest, NotFound, ShuttingDown
from tangramd import events as ev
from tangramd.state.dispatch import handles
from tangramd.state.envs import EnvRec, ForkGroup, Ready
from tangramd.state.handlers.actions import close_env, finish_action
from tangramd.state.story import note

if TYPE_CHECKING:
    from tangramd.state.context import Core


# ---------------------------------------------------------------------- handlers
@handles(ev.OpenEnv)
def open_env(core: Core, e: ev.OpenEnv, now: float, out: list[ev.Command]) -> None:
    if core.shutting_down:
        raise ShuttingDown("daemon is shutting down")
    core.envs.open(
        now,
        out,
        core.stimulus,
        image=e.image,
        mem=e.mem,
        trajectory=e.trajectory,
        throwaway=False,
        token=e.token,
        conn=e.conn,
        owner=e.peer,
        deadline=None if e.timeout_s is None else now + e.timeout_s,
    )


@handles(ev.CloseEnv)
def close(core: Core, e: ev.CloseEnv, now: float, out: list[ev.Command]) -> None:
    env = core.envs.open_env(e.env_id, e.peer)
    if env is None:
        raise NotFound(f"environment {e.env_id!r} not found")
    env.close_token = e.token
    close_env(core, env, now, out, "closed by client")


@handles(ev.ForkEnv)
def fork_env(core: Core, e: ev.ForkEnv, now: float, out: list[ev.Command]) -> None:
    """``env.fork``: the children are created on the source's node (``CreateEnv`` with
    ``fork_of``), each holding the source's memory, and answered together."""
    if core.shutting_down:
        raise ShuttingDown("daemon is shutting down")
    src = core.ready_env(e.env_id, e.peer)
    if not core.cfg.forks:
        raise BadRequest(
            "env.fork is not supported on a cluster coordinator yet: fork on the "
            "environment's node (tangramd up)"
        )
    _refuse_busy(core, src, "fork")
    core.envs.fork(src, e.n, now, out, core.stimulus, e.token)


@handles(ev.ResetEnv)
def reset_env(core: Core, e: ev.ResetEnv, now: float, out: list[ev.Command]) -> None:
    """``env.reset``: the backend puts the files back as at the fork point (or opening)."""
    env = core.ready_env(e.env_id, e.peer)
    _refuse_busy(core, env, "reset")
    env.last_used = now
    note(env, now, "reset", "files back to its fork point (or its opening)", core.stimulus)
    out.append(
        ev.RunTransfer(
            token=e.token,
            env_id=env.id,
            node=env.node,
            direction="reset",
            path="",
            max_bytes=0,
            cause=core.stimulus,
        )
    )


def _refuse_busy(core: Core, env: EnvRec, what: str) -> None:
    """Running processes are not copied: an environment with an action submitted or a
    session open is not forked or reset (refused, not waited for)."""
    sessions = sum(1 for s in core.sessions if s.env == env.id and s.state != "closed")
    if env.active or sessions:
        raise BadRequest(
            f"env.{what}: environment {env.id} has {env.active} action(s) not done and "
            f"{sessions} session(s) open; {what} it once they are done and closed"
        )


def _fork_child_done(
    core: Core, env: EnvRec, error: str | None, now: float, out: list[ev.Command]
) -> None:
    group = env.fork
    assert group is not None
    group.left -= 1
    if error is not None:
        group.errors.append(error)
        close_env(core, env, now, out, f"fork failed: {error}")
    if group.left > 0:
        return
    _answer_fork(core, group, now, out)


def _answer_fork(core: Core, group: ForkGroup, now: float, out: list[ev.Command]) -> None:
    if group.errors:  # all or nothing: the children made are closed again
        for env_id in group.ids:
            child = core.envs.get(env_id)
            if child is not None and child.state == "ready":
                close_env(core, child, now, out, "another child of its fork failed")
        if group.token is not None:
            out.append(core.reply(group.token, error=("infra_error", group.errors[0])))
        return
    if group.token is not None:
        result = {"ids": list(group.ids), "fork_s": now - group.started}
        out.append(core.reply(group.token, result=result))


@handles(ev.EnvCreated)
def env_created(core: Core, e: ev.EnvCreated, now: float, out: list[ev.Command]) -> None:
    answer = core.envs.created(e.env_id, e.error, now, core.stimulus)
    if answer is None:
        return
    env = answer.env
    if env.fork is not None:
        if isinstance(answer, Ready) and core.cfg.record_envs:
            record = core.envs.record(env)
            out.append(ev.RecordEnv(env_id=env.id, record=record, cause=core.stimulus))
        _fork_child_done(core, env, None if isinstance(answer, Ready) else answer.error, now, out)
        return
    token, env.open_token = env.open_token, None
    if isinstance(answer, Ready):
        if not env.throwaway and core.cfg.record_envs:
            record = core.envs.record(env)
            out.append(ev.RecordEnv(env_id=env.id, record=record, cause=core.stimulus))
        if token is not None:
            out.append(core.reply(token, result={"id": env.id, "node": env.node}))
        for aid in answer.pending:
            core.enqueue(core.actions[aid], now)
        return
    if token is not None:
        out.append(core.reply(token, error=("infra_error", answer.error)))
    for aid in answer.pending:
        finish_action(
            core,
            core.actions[aid],
            now,
            out,
            outcome="infra_error",
            detail=f"environment creation failed: {answer.error}",
        )
    close_env(core, env, now, out, f"creation failed: {answer.error}")


@handles(ev.EnvRemoved)
def env_removed(core: Core, e: ev.EnvRemoved, now: float, out: list[ev.Command]) -> None:
    gone = core.envs.removed(e.env_id, now, out, core.stimulus)
    if gone is None:
        return
    for token in core.sessions.forget_env(gone.env.id, now, core.stimulus):
        out.append(core.reply(token, error=("not_found", "environment removed")))
    if not gone.env.throwaway and not core.shutting_down and core.cfg.record_envs:
        out.append(ev.RecordEnv(env_id=gone.env.id, record=None, cause=core.stimulus))
    if gone.env.close_token is not None:
        out.insert(0, core.reply(gone.env.close_token, result={"closed": True}))


@handles(ev.EnvsRecovered)
def envs_recovered(core: Core, e: ev.EnvsRecovered, now: float, out: list[ev.Command]) -> None:
    adopted = core.envs.adopt(e.envs, now, core.stimulus)
    if len(adopted) != len(e.envs):
        persist_envs(core, out)  # forget the records that could not be adopted


def persist_envs(core: Core, out: list[ev.Command]) -> None:
    if core.cfg.record_envs:
        out.append(ev.PersistEnvs(envs=core.envs.records(), cause=core.stimulus))


# ---------------------------------------------------------------------- environment I/O
@handles(ev.PutFile)
def put_file(core: Core, e: ev.PutFile, now: float, out: list[ev.Command]) -> None:
    _transfer(core, e, "put", e.data, e.tar, now, out)


@handles(ev.GetFile)
def get_file(core: Core, e: ev.GetFile, now: float, out: list[ev.Command]) -> None:
    _transfer(core, e, "get", b"", False, now, out)


def _transfer(
    core: Core,
    e: ev.PutFile | ev.GetFile,
    direction: str,
    data: bytes,
    tar: bool,
    now: float,
    out: list[ev.Command],
) -> None:
    env = core.ready_env(e.env_id, e.peer)
    env.last_used = now
    out.append(
        ev.RunTransfer(
            token=e.token,
            env_id=env.id,
            node=env.node,
            direction=direction,
            path=e.path,
            data=data,
            tar=tar,
            max_bytes=core.cfg.max_transfer,
            cause=core.stimulus,
        )
    )


@handles(ev.TransferDone)
def transfer_done(core: Core, e: ev.TransferDone, now: float, out: list[ev.Command]) -> None:
    env = core.envs.get(e.env_id)
    if env is not None:
        env.last_used = now
    if e.token is not None:
        out.append(core.reply(e.token, result=e.result, error=e.error))
