"""The session book: persistent shells in environments, one command at a time each."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from tangram.model import ActionId, EnvId
from tangram.protocol.errors import BadRequest, NotFound
from tangramd.state.story import Stories, StoryLog, transition

if TYPE_CHECKING:
    from tangramd.state.envs import EnvBook

SessionState = Literal["new", "opening", "open", "closing", "closed"]

SESSION_EDGES: dict[tuple[SessionState, SessionState], str] = {
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
    state: SessionState = "new"
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

    def move(
        self, session: SessionRec, new: SessionState, now: float, why: str, cause: int
    ) -> None:
        transition(session, new, SESSION_EDGES, now, why, cause)

    def drop(self, session_id: str) -> SessionRec | None:
        return self._sessions.pop(session_id, None)

    def idle(self, session_id: str, action_id: ActionId) -> None:
        session = self._sessions.get(session_id)
        if session is not None and session.busy == action_id:
            session.busy = None

    def forget_env(self, env_id: str, now: float, cause: int) -> list[int]:
        """The environment was removed: its shells went with it. Returns the tokens of the
        requests still waiting on them (to be answered ``not_found``)."""
        tokens: list[int] = []
        for session in [s for s in self._sessions.values() if s.env == env_id]:
            del self._sessions[session.id]
            self.move(session, "closed", now, "environment removed", cause)
            tokens += [t for t in (session.open_token, session.close_token) if t is not None]
        return tokens
