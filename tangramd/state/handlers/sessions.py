"""Shell sessions: open, opened, interrupt, close, closed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tangram.protocol.errors import NotFound, ShuttingDown
from tangramd import events as ev
from tangramd.state.dispatch import handles

if TYPE_CHECKING:
    from tangramd.state.context import Core


# ---------------------------------------------------------------------- handlers
@handles(ev.OpenSession)
def open_session(core: Core, e: ev.OpenSession, now: float, out: list[ev.Command]) -> None:
    if core.shutting_down:
        raise ShuttingDown("daemon is shutting down")
    env = core.ready_env(e.env_id, e.peer)
    env.last_used = now
    session = core.sessions.open(core.new_id("s"), env.id, env.node, e.token, now, core.stimulus)
    run_as = e.peer if core.cfg.exec_as_peer else None
    out.append(
        ev.StartShell(
            session_id=session.id, env_id=env.id, node=env.node, run_as=run_as, cause=core.stimulus
        )
    )


@handles(ev.SessionOpened)
def session_opened(core: Core, e: ev.SessionOpened, now: float, out: list[ev.Command]) -> None:
    book = core.sessions
    session = book.get(e.session_id)
    if session is None:
        return
    token, session.open_token = session.open_token, None
    if e.error is not None:
        if session.state == "opening":
            book.move(session, "closed", now, e.error, core.stimulus)
        book.drop(session.id)
        if token is not None:
            out.append(core.reply(token, error=("infra_error", e.error)))
        return
    if session.state != "opening":  # closed while starting: end the shell (again)
        out.append(ev.EndShell(session_id=session.id, node=session.node, cause=core.stimulus))
        if token is not None:
            out.append(core.reply(token, error=("not_found", "session closed meanwhile")))
        return
    book.move(session, "open", now, "shell started", core.stimulus)
    if token is not None:
        out.append(core.reply(token, result={"id": session.id, "env": session.env}))


@handles(ev.InterruptSession)
def interrupt_session(
    core: Core, e: ev.InterruptSession, now: float, out: list[ev.Command]
) -> None:
    session = core.sessions.usable(e.session_id, e.peer)
    busy = session.busy is not None
    if busy:
        out.append(ev.InterruptShell(session_id=session.id, node=session.node, cause=core.stimulus))
    if e.token is not None:
        out.append(core.reply(e.token, result={"interrupted": busy}))


@handles(ev.CloseSession)
def close_session(core: Core, e: ev.CloseSession, now: float, out: list[ev.Command]) -> None:
    session = core.sessions.get(e.session_id)
    if (
        session is None
        or session.state in ("closing", "closed")
        or core.envs.open_env(session.env, e.peer) is None
    ):
        raise NotFound(f"session {e.session_id!r} not found")
    core.sessions.move(session, "closing", now, "session.close", core.stimulus)
    session.close_token = e.token
    out.append(ev.EndShell(session_id=session.id, node=session.node, cause=core.stimulus))


@handles(ev.SessionClosed)
def session_closed(core: Core, e: ev.SessionClosed, now: float, out: list[ev.Command]) -> None:
    session = core.sessions.drop(e.session_id)
    if session is None:
        return
    if session.state == "closing":
        core.sessions.move(session, "closed", now, "shell ended", core.stimulus)
    if session.close_token is not None:
        out.append(core.reply(session.close_token, result={"closed": True}))
