"""One story log for every record kind: transitions and notes, kept after the record ends.

Every record with a life cycle (action, environment, session, lease) moves only through
:func:`transition`, along an edge of its book's table (births included: every record is
born in ``"new"``), and the move is written to the record's story with the stimulus id
that caused it. ``tangramctl story ID`` reads any of them back: the :class:`Stories` of a
core are keyed by record id (actions ``a…``, calls ``c…``, leases ``l…``, environments
``e…``, sessions ``s…``). A lease is an action: the lease record writes into its
action's story.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

S = TypeVar("S", bound=str)  # one record kind's states (a Literal of its table's states)
Edges = Mapping[tuple[S, S], str]  # (from, to) -> the real event that causes the edge
StoryLog = list[tuple[float, str, str, Any, int]]  # (t, old, new, why, cause) per entry
STORY_ENTRIES = 64  # per record; an action has about eight entries, an environment a few
STORY_LIMIT = 10_000  # records whose story is kept after they end


class IllegalTransition(RuntimeError):
    """A record was asked to move along an edge its table does not have (a bug)."""


class Record(Protocol[S]):
    """What :func:`transition` needs of a record: its state and its story."""

    state: S
    history: StoryLog


def transition(
    entity: Record[S], new: S, edges: Edges[S], now: float, why: str, cause: int
) -> None:
    """Move ``entity`` along one edge of ``edges`` and write it to the entity's story.

    ``cause`` (the stimulus id of the event being handled) is required: every entry says
    which event made it. An edge not in ``edges`` raises :class:`IllegalTransition` with
    the entity's recent story.
    """
    old = entity.state
    log = entity.history
    if (old, new) not in edges:
        raise IllegalTransition(
            f"{type(entity).__name__} {old} -> {new} ({why}); history: {log[-16:]}"
        )
    entity.state = new
    if len(log) < STORY_ENTRIES:
        log.append((now, old, new, why, cause))


def note(entity: Any, now: float, what: str, detail: Any, cause: int) -> None:
    """Write a story entry that is not a state change (submission, placement)."""
    log: StoryLog = entity.history
    if len(log) < STORY_ENTRIES:
        log.append((now, entity.state, what, detail, cause))


class Stories:
    """The stories of the last ``limit`` records of any kind, oldest dropped.

    A story is the record's own log (its ``history``): the record and the story share one
    list, so there is one log, and it outlives the record.
    """

    def __init__(self, limit: int = STORY_LIMIT) -> None:
        self._limit = limit
        self._logs: OrderedDict[str, StoryLog] = OrderedDict()
        self._kinds: dict[str, str] = {}

    def open(self, record_id: str, kind: str = "action") -> StoryLog:
        """A new, empty story for ``record_id`` (a record of ``kind``)."""
        log: StoryLog = []
        self._logs[record_id] = log
        self._kinds[record_id] = kind
        if len(self._logs) > self._limit:
            gone, _ = self._logs.popitem(last=False)
            self._kinds.pop(gone, None)
        return log

    def get(self, record_id: str) -> StoryLog | None:
        return self._logs.get(record_id)

    def kind(self, record_id: str) -> str | None:
        return self._kinds.get(record_id)


class PlacementNote:
    """A placement's story detail, as text only when a story is read: a pass places
    hundreds of actions, and formatting each one's detail would cost a share of the pass."""

    __slots__ = ("expected_s", "node", "pool_id", "units", "why")

    def __init__(
        self,
        pool_id: str,
        units: tuple[int, ...],
        node: str | None,
        expected_s: float,
        why: object = None,  # an exec's DopWhy (tangram.sched.explain): why this many cores
    ) -> None:
        self.pool_id, self.units, self.node, self.expected_s = pool_id, units, node, expected_s
        self.why = why

    def __str__(self) -> str:
        node = f" node={self.node}" if self.node is not None else ""
        units = list(self.units)
        why = "" if self.why is None else f"; {self.why}"
        return f"pool={self.pool_id} units={units}{node} expected_s={self.expected_s:.3g}{why}"

    def __repr__(self) -> str:  # as the text would be (in an illegal transition's message)
        return repr(str(self))
