"""The lease book: API leases (rate-limited calls held by a client between grant and
release). A lease is an action on an API pool: its record writes into that action's story."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from tangram.model import ActionId
from tangramd.state.story import StoryLog, transition

if TYPE_CHECKING:
    pass

LeaseState = Literal["new", "waiting", "granted", "released", "expired", "failed", "withdrawn"]

LEASE_EDGES: dict[tuple[LeaseState, LeaseState], str] = {
    ("new", "waiting"): "lease.acquire queued the lease action",
    ("waiting", "granted"): "the scheduler placed the lease action on the API pool",
    ("waiting", "failed"): "deadline passed or client disconnected before a grant",
    ("waiting", "withdrawn"): "lease.release before a grant",
    ("granted", "released"): "lease.release, or the holder's connection closed",
    ("granted", "expired"): "TTL passed without a release",
}


@dataclass
class LeaseRec:
    action_id: ActionId
    api: str
    ttl_s: float
    policy: str
    deadline_at: float | None
    history: StoryLog  # the lease action's story
    state: LeaseState = "new"
    expires_at: float = math.inf
    conn: int | None = None


class LeaseBook:
    """Leases waiting or granted; ended ones are dropped at the next tick."""

    def __init__(self) -> None:
        self._leases: dict[ActionId, LeaseRec] = {}

    def get(self, lease_id: str) -> LeaseRec | None:
        return self._leases.get(ActionId(lease_id))

    def __iter__(self) -> Iterator[LeaseRec]:
        return iter(list(self._leases.values()))

    def add(self, lease: LeaseRec, now: float, cause: int) -> None:
        transition(lease, "waiting", LEASE_EDGES, now, "queued for its API", cause)
        self._leases[lease.action_id] = lease

    def move(self, lease: LeaseRec, new: LeaseState, now: float, why: str, cause: int) -> None:
        transition(lease, new, LEASE_EDGES, now, why, cause)

    def granted(self) -> int:
        return sum(1 for lease in self._leases.values() if lease.state == "granted")

    def wakeups(self) -> Iterator[float]:
        """When a granted lease expires or a waiting one reaches its deadline."""
        for lease in self._leases.values():
            if lease.state == "granted":
                yield lease.expires_at
            elif lease.state == "waiting" and lease.deadline_at is not None:
                yield lease.deadline_at

    def drop_ended(self) -> None:
        for lease_id in [
            k
            for k, v in self._leases.items()
            if v.state in ("released", "expired", "failed", "withdrawn")
        ]:
            del self._leases[lease_id]
