"""Life cycles of the daemon's entities, each one explicit transition table.

Every edge carries a comment saying which real event causes it; an illegal transition
raises with the entity's recent history, so a bug shows where it started.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from tangram.model import Action, ActionId, EnvId, TrajectoryId

ACTION_EDGES: dict[tuple[str, str], str] = {
    ("new", "queued"): "submitted with a ready environment",
    ("new", "waiting_env"): "submitted while its environment is being created",
    ("waiting_env", "queued"): "the backend reported the environment created",
    ("waiting_env", "done"): "environment creation failed, env closed, client gone, shutdown",
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
    ("lost", "creating"): "the next action recreates a fresh environment",
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


class IllegalTransition(RuntimeError):
    pass


class _HasState(Protocol):
    state: str


def transition(
    entity: Any, new: str, edges: dict[tuple[str, str], str], now: float, why: str
) -> None:
    old = entity.state
    log = getattr(entity, "history", None)
    if (old, new) not in edges:
        recent = list(log) if log is not None else []
        raise IllegalTransition(
            f"{type(entity).__name__} {old} -> {new} ({why}); history: {recent}"
        )
    entity.state = new
    if log is not None:
        log.append((now, old, new, why))


@dataclass
class ActionRec:
    action: Action
    token: int | None
    env: EnvId | None
    conn: int | None
    submitted_at: float
    request: dict[str, Any] = field(default_factory=dict)
    state: str = "new"
    pool_id: str = ""
    units: tuple[int, ...] = ()
    started_at: float | None = None
    expected_s: float = 0.0
    finished_at: float | None = None
    outcome: str | None = None
    history: deque[tuple[float, str, str, str]] = field(default_factory=lambda: deque(maxlen=16))


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
    state: str = "creating"
    active: int = 0  # actions submitted and not done
    pending: list[ActionId] = field(default_factory=list)
    history: deque[tuple[float, str, str, str]] = field(default_factory=lambda: deque(maxlen=16))


class Story:
    """Bounded log of what happened to each action (``tangramctl story``)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._events: OrderedDict[str, list[tuple[float, str, str]]] = OrderedDict()

    def add(self, action_id: str, now: float, event: str, detail: str = "") -> None:
        log = self._events.get(action_id)
        if log is None:
            log = self._events[action_id] = []
            if len(self._events) > self._limit:
                self._events.popitem(last=False)
        if len(log) < 64:
            log.append((now, event, detail))

    def get(self, action_id: str) -> list[tuple[float, str, str]] | None:
        return self._events.get(action_id)
