"""Deadlines of waits: when a waiting action or environment open gives up.

A request may bound its wait (``exec``'s ``timeout_s`` or ``queue_timeout_s``,
``env.open``'s ``timeout_s``). Its book records the deadline here; the core asks for the
earliest one (``Core.next_wakeup``) so the executor ticks then, and the tick ends the
records whose deadline passed while they still wait. The pass book keeps one more table
(``PassBook.windows``, keyed by API pool id): when a used-up quota's next window opens,
the tick at that time runs a pass for the requests it held back. A record that stops
waiting (placed, created, ended) is dropped; stale heap entries are skipped lazily, so both
cost O(log n).
"""

from __future__ import annotations

import heapq


class Deadlines:
    """Record id -> deadline, with the earliest one at hand."""

    __slots__ = ("_at", "_heap")

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._at: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._at)

    def set(self, record_id: str, at: float) -> None:
        self._at[record_id] = at
        heapq.heappush(self._heap, (at, record_id))

    def drop(self, record_id: str) -> None:
        self._at.pop(record_id, None)

    def get(self, record_id: str) -> float | None:
        return self._at.get(record_id)

    def first(self) -> float | None:
        """The earliest live deadline (None: none)."""
        heap, at = self._heap, self._at
        while heap:
            t, rid = heap[0]
            if at.get(rid) == t:
                return t
            heapq.heappop(heap)
        return None

    def due(self, now: float) -> list[str]:
        """The records whose deadline is ``now`` or earlier, dropped from the table."""
        out: list[str] = []
        while (t := self.first()) is not None and t <= now:
            _, rid = heapq.heappop(self._heap)
            del self._at[rid]
            out.append(rid)
        return out
