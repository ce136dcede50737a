"""Environments: open, close, created, removed, recovered, and file transfers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tangram.protocol.errors import NotFound, ShuttingDown
from tangramd import events as ev
from tangramd.state.dispatch import handles
from tangramd.state.envs import Ready
from tangramd.state.handlers.actions import close_env, finish_action

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


@handles(ev.EnvCreated)
def env_created(core: Core, e: ev.EnvCreated, now: float, out: list[ev.Command]) -> None:
    answer = core.envs.created(e.env_id, e.error, now, core.stimulus)
    if answer is None:
        return
    env = answer.env
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
