"""API endpoint pools (docs/design.md §5.1, the basic manager): concurrency, quota windows, leases.

Contract:

- One ``ApiPool`` per endpoint. Two limits, combinable, 0 meaning unlimited:
  ``concurrency`` (units held at once, by leases and by running api actions together) and
  ``quota`` (grants per fixed window of ``period_s`` seconds; the window containing ``now``
  starts at ``floor(now / period_s) * period_s``).
- A *lease* is a client's grant of one unit with a TTL; it ends by ``release_lease`` or is
  reclaimed by ``advance(now)`` once ``now >= expires_at``. An *action hold* is the
  scheduler's placement of an api action: ``allocate`` / ``release``, no TTL (the driver
  releases it when the action ends). Each unit taken counts against concurrency while held
  and against the quota of the window it was taken in.
- ``overflow`` is the endpoint's policy when a request cannot be granted ('wait', 'reject'
  or 'deadline'); the pool records it and says why (``shortfall``) and when a quota-blocked
  request could next be granted (``next_grant_time``; ``next_window_at``: only when the
  quota is what blocks it, the moment a driver should look again); the manager applies it.
- Pure: no I/O, no clock. Time only enters through ``now`` arguments; the quota window and
  lease expiry move only in ``advance`` (``acquire``/``renew`` roll the window too, so a grant
  is never counted against a stale window, but never reclaim leases).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from tangram.model import Action, ActionId, LeaseId, Shortfall
from tangram.sched.operators import BaseOperator

Overflow = Literal["wait", "reject", "deadline"]
OVERFLOW_POLICIES: tuple[str, ...] = get_args(Overflow)

# Capacity reported for a dimension without a limit: large enough never to bind, small enough
# for a DP table over it (the scheduler sizes tables by ``operator().size()``).
UNLIMITED_UNITS = 1 << 16


@dataclass(frozen=True, slots=True)
class Lease:
    """A grant of one unit of ``api`` to a client until ``expires_at`` (unless released)."""

    id: LeaseId
    api: str
    granted_at: float
    expires_at: float


def _check_time(name: str, value: float) -> None:
    if isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


class ApiPool:
    """One API endpoint; a ``SchedPool`` for resource ``api:<name>``."""

    def __init__(
        self,
        name: str,
        concurrency: int = 0,
        quota: int = 0,
        period_s: float = 1.0,
        overflow: Overflow = "wait",
        default_ttl_s: float = 60.0,
    ) -> None:
        if not name or name.strip() != name:
            raise ValueError(f"API name {name!r} must be non-empty without outer spaces")
        if concurrency < 0:
            raise ValueError(f"api:{name}: concurrency must be >= 0 (0 = unlimited)")
        if quota < 0:
            raise ValueError(f"api:{name}: quota must be >= 0 (0 = unlimited)")
        if not (math.isfinite(period_s) and period_s > 0):
            raise ValueError(f"api:{name}: period_s must be a positive number of seconds")
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(
                f"api:{name}: unknown overflow policy {overflow!r} "
                f"(allowed: {', '.join(OVERFLOW_POLICIES)})"
            )
        if not (math.isfinite(default_ttl_s) and default_ttl_s > 0):
            raise ValueError(f"api:{name}: default_ttl_s must be positive")
        self.name = name
        self.pool_id = f"api:{name}"
        self.resource = f"api:{name}"
        self.concurrency = concurrency
        self.quota = quota
        self.period_s = float(period_s)
        self.overflow: Overflow = overflow
        self.default_ttl_s = float(default_ttl_s)
        self.window_start = 0.0
        self.used_in_window = 0  # units granted in the current window
        self.refused = 0  # requests ``acquire`` could not grant (for the overflow policy)
        self._leases: dict[LeaseId, tuple[Lease, int]] = {}  # lease -> (lease, slot)
        self._holds: dict[ActionId, tuple[int, ...]] = {}  # action -> slots
        self._slots: set[int] = set()  # slot ids in use (leases and holds)

    # ------------------------------------------------------------------ SchedPool

    @property
    def capacity(self) -> int:
        return self.concurrency or UNLIMITED_UNITS

    @property
    def in_use(self) -> int:
        return len(self._slots)

    def quota_left(self) -> int:
        """Grants left in the current window (``UNLIMITED_UNITS`` without a quota)."""
        if not self.quota:
            return UNLIMITED_UNITS
        return max(0, self.quota - self.used_in_window)

    def concurrency_left(self) -> int:
        return max(0, self.capacity - self.in_use)

    def free_units(self) -> int:
        return min(self.concurrency_left(), self.quota_left())

    def max_single(self) -> int:
        return min(self.capacity, self.quota or UNLIMITED_UNITS)

    def operator(self) -> BaseOperator:
        return BaseOperator(self.free_units())

    def never_fits(self, action: Action) -> Shortfall | None:
        amounts = action.demand.get(self.resource)
        if amounts is None:
            return None
        need = amounts.min
        if self.concurrency and need > self.concurrency:
            return Shortfall(
                self.resource,
                need,
                self.free_units(),
                self.concurrency,
                f"needs {need} concurrent units, {self.pool_id} allows {self.concurrency}",
            )
        if self.quota and need > self.quota:
            return Shortfall(
                self.resource,
                need,
                self.free_units(),
                self.quota,
                f"needs {need} units, {self.pool_id} grants {self.quota} per {self.period_s:g}s",
            )
        return None

    def extra_cost(self, action: Action, amount: int) -> float:
        return 0.0

    def pick_units(self, requests: Sequence[tuple[Action, int]]) -> list[tuple[int, ...]]:
        total = sum(amount for _, amount in requests)
        if any(amount < 0 for _, amount in requests):
            raise ValueError(f"{self.pool_id}: negative amount in {list(requests)}")
        if total > self.free_units():
            raise ValueError(
                f"{self.pool_id}: needs {total} units, {self.free_units()} free "
                f"(in use {self.in_use}, quota left {self.quota_left()})"
            )
        slots = iter(self._free_slots(total))
        return [tuple(next(slots) for _ in range(amount)) for _, amount in requests]

    def allocate(self, action_id: ActionId, units: tuple[int, ...]) -> None:
        """Hold ``units`` (slot ids) for a running api action, counted against both limits."""
        if action_id in self._holds:
            raise ValueError(f"{self.pool_id}: action {action_id} already holds units")
        if len(set(units)) != len(units) or any(u < 0 for u in units):
            raise ValueError(f"{self.pool_id}: bad slot ids {units}")
        taken = self._slots.intersection(units)
        if taken:
            raise ValueError(f"{self.pool_id}: slots {sorted(taken)} are in use")
        if len(units) > self.free_units():
            raise ValueError(f"{self.pool_id}: needs {len(units)}, {self.free_units()} free")
        if self.concurrency and any(u >= self.concurrency for u in units):
            raise ValueError(f"{self.pool_id}: slot ids must be < {self.concurrency}")
        self._holds[action_id] = tuple(sorted(units))
        self._slots.update(units)
        self.used_in_window += len(units)

    def release(self, action_id: ActionId) -> tuple[int, ...]:
        """Return a running action's units; ``KeyError`` if it holds none here."""
        try:
            units = self._holds.pop(action_id)
        except KeyError:
            raise KeyError(f"{self.pool_id}: action {action_id} holds no units") from None
        self._slots.difference_update(units)
        return units

    # ------------------------------------------------------------------ time

    def window_of(self, now: float) -> float:
        """Start of the quota window containing ``now``."""
        return math.floor(now / self.period_s) * self.period_s

    def advance(self, now: float) -> list[LeaseId]:
        """Roll the quota window to ``now`` and reclaim expired leases (their ids, by expiry)."""
        _check_time("now", now)
        self._roll_window(now)
        expired = sorted(
            (lease for lease, _ in self._leases.values() if lease.expires_at <= now),
            key=lambda lease: (lease.expires_at, lease.id),
        )
        for lease in expired:
            self._drop_lease(lease.id)
        return [lease.id for lease in expired]

    def next_grant_time(self, now: float) -> float | None:
        """When a waiting request could next be granted: ``now`` if it could be now, the next
        window start if only the quota blocks it, None if concurrency blocks it (that frees
        when a holder releases, which the pool cannot foresee)."""
        if self.concurrency_left() == 0:
            return None
        window = self.window_of(now)
        if not self.quota or window > self.window_start or self.quota_left() > 0:
            return now
        return window + self.period_s

    def next_window_at(self, now: float) -> float | None:
        """When the quota window after the one containing ``now`` opens, if the quota is
        all that keeps the pool from granting a unit at ``now``: a quota is set, a
        concurrency unit is free, and the quota of ``now``'s window is used up. None
        otherwise: a unit could be granted now, or only a release frees one (concurrency),
        which the pool cannot foresee. A pure function of ``now`` and the pool's state;
        the daemon runs a pass then for the requests waiting on the pool (the first
        moment ``window_of`` names the next window, so that pass finds the quota back)."""
        if not self.quota or self.concurrency_left() == 0:
            return None
        window = self.window_of(now)
        if window > self.window_start or self.used_in_window < self.quota:
            return None
        k = math.floor(now / self.period_s)
        at = (k + 1) * self.period_s
        while math.floor(at / self.period_s) <= k:  # (rounding: never a moment early)
            at = math.nextafter(at, math.inf)
        return at

    def _roll_window(self, now: float) -> None:
        window = self.window_of(now)
        if window > self.window_start:
            self.window_start = window
            self.used_in_window = 0

    # ------------------------------------------------------------------ leases

    def acquire(self, lease_id: LeaseId, now: float, ttl_s: float | None = None) -> Lease | None:
        """Grant one unit until ``now + ttl_s``; None (and ``refused`` + 1) if none is free.

        Acquiring a lease id that is already held returns that lease unchanged (a client's
        retry must not take a second unit).
        """
        _check_time("now", now)
        ttl = self._ttl(ttl_s)
        held = self._leases.get(lease_id)
        if held is not None:
            return held[0]
        self._roll_window(now)
        if self.free_units() < 1:
            self.refused += 1
            return None
        slot = self._free_slots(1)[0]
        lease = Lease(lease_id, self.name, now, now + ttl)
        self._leases[lease_id] = (lease, slot)
        self._slots.add(slot)
        self.used_in_window += 1
        return lease

    def renew(self, lease_id: LeaseId, now: float, ttl_s: float | None = None) -> Lease | None:
        """Extend a live lease to ``now + ttl_s`` (a heartbeat); None if it is gone."""
        _check_time("now", now)
        ttl = self._ttl(ttl_s)
        held = self._leases.get(lease_id)
        if held is None or held[0].expires_at <= now:
            return None
        lease = Lease(lease_id, self.name, held[0].granted_at, now + ttl)
        self._leases[lease_id] = (lease, held[1])
        return lease

    def release_lease(self, lease_id: LeaseId) -> bool:
        """End a lease; True if it was held, False if already gone (idempotent)."""
        if lease_id not in self._leases:
            return False
        self._drop_lease(lease_id)
        return True

    def lease(self, lease_id: LeaseId) -> Lease | None:
        held = self._leases.get(lease_id)
        return None if held is None else held[0]

    def leases(self) -> tuple[Lease, ...]:
        return tuple(lease for lease, _ in self._leases.values())

    def shortfall(self) -> Shortfall | None:
        """Why one more unit cannot be granted now (reason 'concurrency' or 'quota'), or None."""
        if self.concurrency_left() == 0:
            return Shortfall(self.resource, 1, 0, self.capacity, "concurrency")
        if self.quota_left() == 0:
            return Shortfall(self.resource, 1, 0, self.quota, "quota")
        return None

    def _ttl(self, ttl_s: float | None) -> float:
        ttl = self.default_ttl_s if ttl_s is None else ttl_s
        if isinstance(ttl, bool) or not (math.isfinite(ttl) and ttl > 0):
            raise ValueError(f"{self.pool_id}: lease TTL must be positive, got {ttl_s!r}")
        return float(ttl)

    def _drop_lease(self, lease_id: LeaseId) -> None:
        _, slot = self._leases.pop(lease_id)
        self._slots.discard(slot)

    def _free_slots(self, count: int) -> list[int]:
        slots: list[int] = []
        candidate = 0
        while len(slots) < count:
            if candidate not in self._slots:
                slots.append(candidate)
            candidate += 1
        return slots

    # ------------------------------------------------------------------ invariants

    def validate(self) -> None:
        """Raise ``AssertionError`` if an invariant is broken (tests run it at teardown)."""
        slots = [slot for _, slot in self._leases.values()]
        slots += [slot for units in self._holds.values() for slot in units]
        assert len(slots) == len(set(slots)), "a slot is held twice"
        assert set(slots) == self._slots, "slot bookkeeping disagrees"
        if self.concurrency:
            assert self.in_use <= self.concurrency, "concurrency exceeded"
            assert all(slot < self.concurrency for slot in slots), "slot beyond concurrency"
        if self.quota:
            assert self.used_in_window <= self.quota, "quota exceeded"

    def __repr__(self) -> str:
        return (
            f"ApiPool({self.name!r}, in_use={self.in_use}, concurrency={self.concurrency}, "
            f"quota={self.used_in_window}/{self.quota} per {self.period_s:g}s)"
        )
