"""The session book: persistent shells in environments, one command at a time each."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tangram.model import ActionId, EnvId
from tangram.protocol.errors import BadRequest, NotFound, ShuttingDown
from tangramd import events as ev
from tangramd.state.dispatch import handles
from tangramd.state.story import Stories, StoryLog, transition

if TYPE_CHECKING:
    from tangramd.state.core import Core
    from tangramd.state.envs import EnvBook

SESSION_EDGES: dict[tuple[str, str], str] = {
    ("new", "opening"): "session.open on a ready environment",
    ("opening", "open"): "the backend started the session's shell",
    ("opening", "closed"): "the shell could not be started, or its environment went away",
    ("open", "closing"): "session.close, or its environment is being closed",
    ("opening", "closing"): "session.close before the shell was up",
    ("closing", "closed"): "the backend ended the shell",
    ("open", "closed"): "its environment was removed",
}


@dataclass
class SessionRec:
    """A persistent shell in an environment; ``busy`` is the action running in it."""

    id: str
    env: EnvId
    node: str
    history: StoryLog
    state: str = "new"
    open_token: int | None = None
    close_token: int | None = None
    busy: ActionId | None = None


class SessionBook:
    """The sessions of every environment of one core."""

    def __init__(self, envs: EnvBook, stories: Stories) -> None:
        self.envs = envs
        self.stories = stories
        self._sessions: dict[str, SessionRec] = {}

    # ------------------------------------------------------------------ reads
    def get(self, session_id: str) -> SessionRec | None:
        return self._sessions.get(session_id)

    def __getitem__(self, session_id: str) -> SessionRec:
        return self._sessions[session_id]

    def __iter__(self) -> Iterator[SessionRec]:
        return iter(list(self._sessions.values()))

    def __len__(self) -> int:
        return len(self._sessions)

    def usable(self, session_id: str, peer: tuple[int, int] | None) -> SessionRec:
        """An open session whose environment ``peer`` may use (else, as if none)."""
        session = self._sessions.get(session_id)
        if (
            session is None
            or session.state != "open"
            or self.envs.open_env(session.env, peer) is None
        ):
            raise NotFound(f"session {session_id!r} not found (or not open)")
        return session

    def for_exec(
        self, session_id: str, env_id: str | None, peer: tuple[int, int] | None
    ) -> SessionRec:
        """The session a command is submitted to: usable, of ``env_id``, and idle."""
        session = self.usable(session_id, peer)
        if env_id is not None and env_id != session.env:
            raise BadRequest(f"session {session_id} belongs to environment {session.env}")
        if session.busy is not None:
            raise BadRequest(f"session {session_id} is busy with {session.busy}")
        return session

    def rows(self) -> list[dict[str, Any]]:
        return [
            {"id": s.id, "env": s.env, "state": s.state, "busy": s.busy}
            for s in self._sessions.values()
        ]

    # ------------------------------------------------------------------ changes
    def open(
        self, session_id: str, env_id: EnvId, node: str, token: int | None, now: float, cause: int
    ) -> SessionRec:
        session = SessionRec(
            id=session_id,
            env=env_id,
            node=node,
            history=self.stories.open(session_id, "session"),
            open_token=token,
        )
        transition(session, "opening", SESSION_EDGES, now, "session.open", cause)
        self._sessions[session_id] = session
        return session

    def move(self, session: SessionRec, new: str, now: float, why: str, cause: int) -> None:
        transition(session, new, SESSION_EDGES, now, why, cause)

    def drop(self, session_id: str) -> SessionRec | None:
        return self._sessions.pop(session_id, None)

    def idle(self, session_id: str, action_id: ActionId) -> None:
        session = self._sessions.get(session_id)
        if session is not None and session.busy == action_id:
            session.busy = None

    def forget_env(self, core: Core, env_id: str, now: float, out: list[ev.Command]) -> None:
        """The environment was removed: its shells went with it."""
        for session in [s for s in self._sessions.values() if s.env == env_id]:
            del self._sessions[session.id]
            self.move(session, "closed", now, "environment removed", core.stimulus)
            for token in (session.open_token, session.close_token):
                if token is not None:
                    out.append(core.reply(token, error=("not_found", "environment removed")))


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
