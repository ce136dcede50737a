"""The action book: live actions, the queue, and how an action ends.

An action is one atomic call (an exec, a lease, a service call). The book holds the live
ones, the FCFS queue of those waiting for units, and the outcome of recently ended ones;
their stories stay in the core's :class:`~tangramd.state.story.Stories`. What the events
do with them is :mod:`tangramd.state.handlers.actions` (where
:func:`~tangramd.state.handlers.actions.finish_action` is the one way any action ends).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from tangram.model import Action, ActionId, EnvId
from tangram.protocol.errors import BadRequest
from tangram.protocol.results import CallSpec, ExecSpec
from tangramd.state.deadlines import Deadlines
from tangramd.state.story import STORY_LIMIT, Stories, StoryLog, transition

if TYPE_CHECKING:
    pass

ActionState = Literal["new", "queued", "waiting_env", "running", "done"]

ACTION_EDGES: dict[tuple[ActionState, ActionState], str] = {
    ("new", "queued"): "submitted with a ready environment",
    ("new", "waiting_env"): "submitted while its environment is being created",
    ("waiting_env", "queued"): "the backend reported the environment created",
    ("waiting_env", "done"): (
        "env creation failed or closed, wait timed out, cancelled, client gone, shutdown"
    ),
    ("queued", "waiting_env"): "its node was lost; its throwaway env is recreated elsewhere",
    ("queued", "running"): "the scheduler placed it and the pool allocated its units",
    ("queued", "done"): (
        "infeasible, lease deadline or wait timeout passed, cancelled, client gone, shutdown"
    ),
    ("running", "done"): (
        "the backend finished the exec (killed, if cancelled) / the lease was released or expired"
    ),
}


STORY_KIND = {"api": "lease", "service": "call"}  # what ``tangramctl story`` calls them


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
    state: ActionState = "new"
    pool_id: str = ""
    units: tuple[int, ...] = ()
    # its units on other pools, taken and given back with ``units`` (joint admission)
    also: tuple[tuple[str, tuple[int, ...]], ...] = ()
    started_at: float | None = None
    expected_s: float = 0.0
    outcome: str | None = None
    # exec actions: the command's timeout bounds its wait too (no queue_timeout_s given),
    # so it runs for what is left of it (see ``handlers.actions.run_exec``)
    bounds_run: bool = False
    owner: tuple[int, int] | None = None  # (uid, gid) of the client that submitted it
    cancelling: bool = False  # a cancel killed it: it ends ``cancelled`` (unless it was ok)
    cancel_tokens: list[int] = field(default_factory=list)  # cancels answered at its end
    # cancels of its job (``cancel`` with job and all) waiting for it among others to end
    job_cancels: list[JobCancel] = field(default_factory=list)


@dataclass
class JobCancel:
    """One ``cancel`` of a job's actions: answered (``{"job", "actions"}``) once the running
    execs it killed have ended; ``rows`` is each action's line, as ``cancel`` answers it."""

    token: int | None
    job: str
    rows: dict[str, dict[str, object]] = field(default_factory=dict)
    pending: set[str] = field(default_factory=set)

    def answer(self) -> dict[str, object]:
        return {"job": self.job, "actions": list(self.rows.values())}


class ActionBook:
    """Live actions (``live``), the FCFS queue and the recent outcomes."""

    def __init__(self, stories: Stories) -> None:
        self.stories = stories
        self.live: dict[ActionId, ActionRec] = {}
        self.queue: dict[ActionId, ActionRec] = {}  # waiting for units, FCFS (seq) order
        self.recent: OrderedDict[ActionId, str] = OrderedDict()  # outcome of ended ones
        self.owners: dict[ActionId, tuple[int, int]] = {}  # of those in ``recent`` (known)
        self.finished: deque[tuple[str, float, float]] = deque(maxlen=4096)  # kind, queue, exec
        # actions queued since the last pass (insertion order): the short pass reads them
        self.fresh: dict[ActionId, None] = {}
        # waiting actions that give up at a deadline (their timeout or queue timeout)
        self.deadlines = Deadlines()
        # live execs' and calls' client names: (connection, ref) -> action (``cancel`` by ref)
        self.refs: dict[tuple[int, str], ActionId] = {}
        self._seq = itertools.count(1)

    # ------------------------------------------------------------------ reads
    def get(self, action_id: str) -> ActionRec | None:
        return self.live.get(ActionId(action_id))

    def __getitem__(self, action_id: ActionId) -> ActionRec:
        return self.live[action_id]

    def __iter__(self) -> Iterator[ActionRec]:
        return iter(list(self.live.values()))

    def __len__(self) -> int:
        return len(self.live)

    def next_seq(self) -> int:
        return next(self._seq)

    def by_ref(self, conn: int | None, ref: str | None) -> ActionRec | None:
        """The live action that the client on ``conn`` named ``ref``."""
        if conn is None or ref is None:
            return None
        aid = self.refs.get((conn, ref))
        return None if aid is None else self.live.get(aid)

    def check_ref(self, conn: int | None, ref: str | None) -> None:
        """Refuse a ``ref`` that already names a live action on this connection (a ref is
        unique on its connection while its action lives; it may be reused after)."""
        held = self.by_ref(conn, ref)
        if held is not None:
            raise BadRequest(
                f"ref: {ref!r} already names live action {held.action.id} on this connection "
                "(a ref is unique on its connection until its action ends)"
            )

    # ------------------------------------------------------------------ changes
    def add(
        self,
        action: Action,
        now: float,
        *,
        token: int | None,
        env: EnvId | None,
        conn: int | None,
        spec: ExecSpec | None = None,
        run_as: tuple[int, int] | None = None,
        call: CallSpec | None = None,
        owner: tuple[int, int] | None = None,
    ) -> ActionRec:
        """A new action, in state ``new``, with a fresh story."""
        rec = ActionRec(
            action=action,
            token=token,
            env=env,
            conn=conn,
            submitted_at=now,
            history=self.stories.open(action.id, STORY_KIND.get(action.kind, "action")),
            spec=spec,
            run_as=run_as,
            call=call,
            owner=owner,
        )
        self.live[action.id] = rec
        ref = _ref_of(rec)
        if conn is not None and ref is not None:  # (its handler called check_ref first)
            self.refs[(conn, ref)] = action.id
        return rec

    def move(self, rec: ActionRec, new: ActionState, now: float, why: str, cause: int) -> None:
        transition(rec, new, ACTION_EDGES, now, why, cause)
        if new in ("running", "done"):  # it waits no more
            self.deadlines.drop(rec.action.id)

    def enqueue(self, rec: ActionRec, now: float, cause: int) -> None:
        self.move(rec, "queued", now, "ready to schedule", cause)
        self.queue[rec.action.id] = rec
        self.fresh[rec.action.id] = None

    def unqueue(self, aid: ActionId) -> ActionRec | None:
        rec = self.queue.pop(aid, None)
        self.fresh.pop(aid, None)
        return rec

    def forget(self, rec: ActionRec, outcome: str) -> None:
        """The action ended: drop the record (its story keeps what happened)."""
        self.live.pop(rec.action.id, None)
        self.deadlines.drop(rec.action.id)
        ref = _ref_of(rec)
        if (
            rec.conn is not None
            and ref is not None
            and self.refs.get((rec.conn, ref)) == rec.action.id
        ):
            del self.refs[(rec.conn, ref)]
        self.recent[rec.action.id] = outcome
        if rec.owner is not None:
            self.owners[rec.action.id] = rec.owner
        if len(self.recent) > STORY_LIMIT:
            old, _ = self.recent.popitem(last=False)
            self.owners.pop(old, None)

    def ended(self, action_id: str, peer: tuple[int, int] | None) -> str | None:
        """The outcome of a recently ended action ``peer`` may see (None: unknown, too old,
        or another user's)."""
        aid = ActionId(action_id)
        outcome = self.recent.get(aid)
        if outcome is None or not may_touch(peer, self.owners.get(aid)):
            return None
        return outcome


def may_touch(peer: tuple[int, int] | None, owner: tuple[int, int] | None) -> bool:
    """Whether ``peer`` may act on a record ``owner`` submitted: its owner, root, or anyone
    when either side is unknown (the rule of environments, ``EnvBook.open_env``)."""
    return peer is None or owner is None or peer[0] in (0, owner[0])


def _ref_of(rec: ActionRec) -> str | None:
    """The client's ``ref`` of an exec or a call (``cancel`` finds it by that)."""
    if rec.spec is not None:
        return rec.spec.ref
    return rec.call.ref if rec.call is not None else None
