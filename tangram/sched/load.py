"""Recent offered load per pool: what the ``priced`` rule reads to price a unit (docs/design.md §4).

Contract
--------
``LoadMeter`` is fed by the driver (daemon or simulator) as actions are submitted, start and
finish, with ``now`` passed in; ``load(pool_id, now)`` returns a frozen ``PoolLoad`` that the
driver puts into the ``Snapshot``. Pure: no clock, no I/O; every method is ``O(1)``
amortised (events leave the window in arrival order).

What it measures, per pool, over the last ``window_s`` seconds (20 by default: a 10 s
window saw one or two test-run starts and forecast a busy or an idle node from them):

- ``elastic_per_s``: elastic actions submitted per second;
- ``elastic_starts_per_s``: elastic actions that went into service (started) per second: the
  ``priced`` rule's forecast of the load in service (the next ``window_s`` seconds are
  assumed to look like the last). Starts, not submissions: an action still queued is
  counted as queued, and a lone action's own submission must not price it against itself;
- ``elastic_mean_s``: the mean expected duration of those starts (at the amounts they
  started with), the ``W`` of Little's law for the elastic actions in service;
- ``short_units``: offered load of non-elastic actions in units (expected unit-seconds of
  the ones started, per second), i.e. how many units short calls keep busy on average;
- ``elastic_running`` / ``elastic_units``: elastic actions holding units now, and how many;
- ``envs``: how many environments live on the pool, as the driver counts them (``load``'s
  argument): every elastic action comes from one, one action at a time, so no more can
  share a run than there are environments. 0 means no such bound: none was given, or an
  elastic action in a throwaway environment (one opened for that action alone, so any
  number more may come) started within the window.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PoolLoad:
    elastic_per_s: float = 0.0
    short_units: float = 0.0
    elastic_running: int = 0
    elastic_units: int = 0
    elastic_starts_per_s: float = 0.0
    elastic_mean_s: float = 0.0
    envs: int = 0  # environments on the pool (0: no bound; module doc)


@dataclass(slots=True)
class _Book:
    arrivals: deque[float] = field(default_factory=deque)
    starts: deque[tuple[float, float]] = field(default_factory=deque)  # (start, expected s)
    starts_sum: float = 0.0
    short: deque[tuple[float, float]] = field(default_factory=deque)  # (start, unit-seconds)
    short_sum: float = 0.0
    running: dict[str, int] = field(default_factory=dict)  # elastic action id -> units
    running_units: int = 0
    throwaway_at: float = -math.inf  # last start of an elastic action in a throwaway env


class LoadMeter:
    """Sliding-window arrival and load counters per pool (see module doc)."""

    __slots__ = ("_books", "window_s")

    def __init__(self, window_s: float = 20.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._books: dict[str, _Book] = {}

    def _book(self, pool_id: str) -> _Book:
        book = self._books.get(pool_id)
        if book is None:
            book = self._books[pool_id] = _Book()
        return book

    def submitted(self, pool_id: str, now: float, elastic: bool) -> None:
        """An action entered the pool's queue (only elastic ones are counted)."""
        if elastic:
            self._book(pool_id).arrivals.append(now)

    def started(
        self,
        pool_id: str,
        action_id: str,
        now: float,
        elastic: bool,
        units: int,
        expected_s: float,
        throwaway: bool = False,
    ) -> None:
        """An action went into service; ``throwaway``: in an environment opened for it alone
        (then the pool's environments bound nothing for a window: ``PoolLoad.envs``)."""
        book = self._book(pool_id)
        if elastic:
            if throwaway:
                book.throwaway_at = now
            book.starts.append((now, expected_s))
            book.starts_sum += expected_s
            book.running[action_id] = units
            book.running_units += units
        else:
            work = units * expected_s
            book.short.append((now, work))
            book.short_sum += work

    def finished(self, pool_id: str, action_id: str) -> None:
        book = self._books.get(pool_id)
        if book is not None:
            units = book.running.pop(action_id, 0)
            book.running_units -= units

    def oldest(self, pool_id: str, now: float) -> float:
        """The earliest time among the pool's entries in the window at ``now`` (its throwaway
        start included): with no new entry, ``load`` returns the same at every later ``t``
        with ``oldest > t - window_s`` (the test ``load`` prunes by). inf when none."""
        book = self._books.get(pool_id)
        if book is None:
            return math.inf
        since = now - self.window_s
        out = book.throwaway_at if book.throwaway_at > since else math.inf
        for t in book.arrivals:
            if t > since:
                out = min(out, t)
                break
        for t, _ in book.starts:
            if t > since:
                out = min(out, t)
                break
        for t, _ in book.short:
            if t > since:
                out = min(out, t)
                break
        return out

    def load(self, pool_id: str, now: float, envs: int = 0) -> PoolLoad:
        """The pool's load now; ``envs``: the environments living on it (0: unknown)."""
        book = self._books.get(pool_id)
        if book is None:
            return PoolLoad(envs=envs)
        since = now - self.window_s
        arrivals, starts, short = book.arrivals, book.starts, book.short
        while arrivals and arrivals[0] <= since:
            arrivals.popleft()
        while starts and starts[0][0] <= since:
            book.starts_sum -= starts.popleft()[1]
        if not starts:
            book.starts_sum = 0.0
        while short and short[0][0] <= since:
            book.short_sum -= short.popleft()[1]
        if not short:
            book.short_sum = 0.0  # no drift from float subtraction
        return PoolLoad(
            len(arrivals) / self.window_s,
            max(book.short_sum, 0.0) / self.window_s,
            len(book.running),
            book.running_units,
            len(starts) / self.window_s,
            max(book.starts_sum, 0.0) / len(starts) if starts else 0.0,
            0 if book.throwaway_at > since else envs,
        )
