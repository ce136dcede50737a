"""Life cycles of the daemon's entities, each one explicit transition table.

Every edge carries a comment saying which real event causes it; an illegal transition
raises with the entity's recent history, so a bug shows where it started.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from tangram.model import Action, ActionId, EnvId, TrajectoryId
from tangram.protocol.results import CallSpec, ExecSpec

ACTION_EDGES: dict[tuple[str, str], str] = {
    ("new", "queued"): "submitted with a ready environment",
    ("new", "waiting_env"): "submitted while its environment is being created",
    ("waiting_env", "queued"): "the backend reported the environment created",
    ("waiting_env", "done"): "environment creation failed, env closed, client gone, shutdown",
    ("queued", "waiting_env"): "its node was lost; its throwaway env is recreated elsewhere",
    ("queued", "running"): "the scheduler placed it and the pool allocated its units",
    ("queued", "done"): "infeasible, lease deadline passed, client gone, or shutdown",
    ("running", "done"): "the backend finished the exec / the lease was released or expired",
}

ENV_EDGES: dict[tuple[str, str], str] = {
    ("new", "creating"): "env.open or a throwaway exec asked for it",
    ("waiting_mem", "creating"): "another environment's memory was freed and it now fits",
    ("waiting_mem", "closing"): "closed (or its client left) before memory became free",
    ("creating", "ready"): "the backend created it",
    ("creating", "closing"): "creation failed, or closed while being created",
    ("ready", "lost"): "an exec found it gone (container died or removed behind our back)",
    ("creating", "lost"): "its node was lost while the environment was being created",
    ("lost", "waiting_mem"): "a throwaway env of a lost node waits for memory on another node",
    ("lost", "creating"): "the next action recreates a fresh environment",
    ("lost", "ready"): "its node reconnected to a restarted coordinator that restored it",
    ("ready", "closing"): "env.close, idle TTL, throwaway done, or shutdown",
    ("lost", "closing"): "env.close of a lost environment",
    ("closing", "closed"): "the backend removed it",
}

LEASE_EDGES: dict[tuple[str, str], str] = {
    ("waiting", "granted"): "the scheduler placed the lease action on the API pool",
    ("waiting", "failed"): "deadline passed or client disconnected before a grant",
    ("granted", "released"): "lease.release, or the holder's connection closed",
    ("granted", "expired"): "TTL passed without a release",
}


SESSION_EDGES: dict[tuple[str, str], str] = {
    ("opening", "open"): "the backend started the session's shell",
    ("opening", "closed"): "the shell could not be started, or its environment went away",
    ("open", "closing"): "session.close, or its environment is being closed",
    ("opening", "closing"): "session.close before the shell was up",
    ("closing", "closed"): "the backend ended the shell",
    ("open", "closed"): "its environment was removed",
}


class IllegalTransition(RuntimeError):
    pass


class _HasState(Protocol):
    state: str


def transition(
    entity: Any,
    new: str,
    edges: dict[tuple[str, str], str],
    now: float,
    why: str,
    cause: int = 0,
) -> None:
    """Move ``entity`` along one edge of ``edges`` and log it in the entity's history."""
    old = entity.state
    log = entity.history
    if (old, new) not in edges:
        raise IllegalTransition(
            f"{type(entity).__name__} {old} -> {new} ({why}); history: {list(log)[-16:]}"
        )
    entity.state = new
    if isinstance(entity, ActionRec):
        if len(log) < STORY_ENTRIES:
            log.append((now, old, new, why, cause))
    else:
        log.append((now, old, new, why))


StoryLog = list[tuple[float, str, str, str, int]]  # (t, old, new, why, cause) per entry
STORY_ENTRIES = 64  # per action; an action has about eight


@dataclass
class ActionRec:
    """A live action. ``history`` is its story: every transition, kept after it ends."""

    action: Action
    token: int | None
    env: EnvId | None
    conn: int | None
    submitted_at: float
    history: StoryLog
    spec: ExecSpec | None = None  # exec actions: the request as submitted
    run_as: tuple[int, int] | None = None  # exec actions: the user the command runs as
    call: CallSpec | None = None  # service actions: the call as submitted
    state: str = "new"
    pool_id: str = ""
    units: tuple[int, ...] = ()
    started_at: float | None = None
    expected_s: float = 0.0
    finished_at: float | None = None
    outcome: str | None = None


@dataclass
class EnvRec:
    id: EnvId
    trajectory: TrajectoryId
    node: str
    image: str | None
    mem: int
    created_at: float
    last_used: float
    throwaway: bool = False
    open_token: int | None = None
    close_token: int | None = None
    conn: int | None = None
    owner: tuple[int, int] | None = None  # (uid, gid) of the client that opened it
    state: str = "creating"
    lost_node: str = ""  # set when the environment was lost with its node (cluster mode)
    awaiting_node: bool = False  # restored by a restarted coordinator, node not back yet
    active: int = 0  # actions submitted and not done
    pending: list[ActionId] = field(default_factory=list)
    history: deque[tuple[float, str, str, str]] = field(default_factory=lambda: deque(maxlen=16))


@dataclass
class SessionRec:
    """A persistent shell in an environment; ``busy`` is the action running in it."""

    id: str
    env: EnvId
    node: str
    state: str = "opening"
    open_token: int | None = None
    close_token: int | None = None
    busy: ActionId | None = None
    history: deque[tuple[float, str, str, str]] = field(default_factory=lambda: deque(maxlen=16))


class Stories:
    """The stories of the last ``limit`` actions (``tangramctl story``), oldest dropped.

    A story is the action's own transition log (``ActionRec.history``): the record and the
    story share one list, so there is one log, and it outlives the record.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._logs: OrderedDict[str, StoryLog] = OrderedDict()

    def open(self, action_id: str) -> StoryLog:
        log: StoryLog = []
        self._logs[action_id] = log
        if len(self._logs) > self._limit:
            self._logs.popitem(last=False)
        return log

    def get(self, action_id: str) -> StoryLog | None:
        return self._logs.get(action_id)


def note(rec: ActionRec, now: float, what: str, detail: str | Placed, cause: int) -> None:
    """Write a story entry that is not a state change (submission, placement)."""
    if len(rec.history) < STORY_ENTRIES:
        rec.history.append((now, rec.state, what, detail, cause))  # type: ignore[arg-type]


class Placed:
    """A placement's story detail, as text only when a story is read: a pass places
    hundreds of actions, and formatting each one's detail was a twentieth of the pass."""

    __slots__ = ("expected_s", "node", "pool_id", "units")

    def __init__(
        self, pool_id: str, units: tuple[int, ...], node: str | None, expected_s: float
    ) -> None:
        self.pool_id, self.units, self.node, self.expected_s = pool_id, units, node, expected_s

    def __str__(self) -> str:
        node = f" node={self.node}" if self.node is not None else ""
        units = list(self.units)
        return f"pool={self.pool_id} units={units}{node} expected_s={self.expected_s:.3g}"

    def __repr__(self) -> str:  # as the text would be (in an illegal transition's message)
        return repr(str(self))
