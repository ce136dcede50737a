"""The lease book: API leases (rate-limited calls held by a client between grant and
release). A lease is an action on an API pool: its record writes into that action's story."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tangram.model import ActionId, InvalidDemand, make_action
from tangram.protocol.errors import NotFound, QuotaExceeded, ShuttingDown
from tangramd import events as ev
from tangramd.state.actions import ActionRec, finish_action
from tangramd.state.dispatch import handles
from tangramd.state.story import StoryLog, note, transition

if TYPE_CHECKING:
    from tangramd.state.core import Core

LEASE_EDGES: dict[tuple[str, str], str] = {
    ("new", "waiting"): "lease.acquire queued the lease action",
    ("waiting", "granted"): "the scheduler placed the lease action on the API pool",
    ("waiting", "failed"): "deadline passed or client disconnected before a grant",
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
    state: str = "new"
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

    def move(self, lease: LeaseRec, new: str, now: float, why: str, cause: int) -> None:
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
            k for k, v in self._leases.items() if v.state in ("released", "expired", "failed")
        ]:
            del self._leases[lease_id]


# ---------------------------------------------------------------------- handlers
@handles(ev.AcquireLease)
def acquire(core: Core, e: ev.AcquireLease, now: float, out: list[ev.Command]) -> None:
    if core.shutting_down:
        raise ShuttingDown("daemon is shutting down")
    pool = core.apis.get(e.api)
    if pool is None:
        names = ", ".join(sorted(core.apis)) or "none configured"
        raise NotFound(f"api {e.api!r} not found (configured: {names})")
    policy = e.policy or pool.overflow
    if policy not in ("wait", "reject", "deadline"):
        raise InvalidDemand("policy", f"unknown policy {policy!r}", "wait, reject, deadline")
    if policy == "reject":
        pool.advance(now)
        busy = any(r.action.key == pool.resource for r in core.actions.queue.values())
        if busy or pool.free_units() < 1:
            raise QuotaExceeded(f"api {e.api!r}: no capacity now (policy reject)")
    aid = ActionId(core.new_id("l"))
    action = make_action(
        aid,
        "api",
        f"lease-{aid}",
        {pool.resource: 1},
        seq=core.actions.next_seq(),
        submitted_at=now,
        klass=f"lease/{e.api}",
    )
    deadline = None
    if policy == "deadline":
        deadline = now + (e.deadline_s if e.deadline_s is not None else core.cfg.default_deadline_s)
    ttl = e.ttl_s if e.ttl_s is not None else pool.default_ttl_s
    rec = core.actions.add(action, now, token=e.token, env=None, conn=e.conn)
    note(rec, now, "submitted", f"lease api={e.api} ttl={ttl} policy={policy}", core.stimulus)
    lease = LeaseRec(aid, e.api, ttl, policy, deadline, history=rec.history, conn=e.conn)
    core.leases.add(lease, now, core.stimulus)
    core.enqueue(rec, now)


def grant_lease(core: Core, rec: ActionRec, now: float, out: list[ev.Command]) -> None:
    """The pass placed the lease action: the lease is granted for its TTL."""
    lease = core.leases.get(rec.action.id)
    assert lease is not None, "a lease action has its lease"
    core.leases.move(lease, "granted", now, "capacity granted", core.stimulus)
    lease.expires_at = now + lease.ttl_s
    if rec.token is not None:
        result = {
            "lease_id": rec.action.id,
            "api": lease.api,
            "ttl_s": lease.ttl_s,
            "queue_s": now - rec.submitted_at,
        }
        out.append(core.reply(rec.token, result=result))
        rec.token = None


def end_lease(core: Core, lease: LeaseRec, now: float, out: list[ev.Command], state: str) -> None:
    rec = core.actions[lease.action_id]
    core.leases.move(lease, state, now, state, core.stimulus)
    if rec.started_at is not None:
        core.history.observe(rec.action.klass, now - rec.started_at)
    outcome = "ok" if state == "released" else state
    finish_action(core, rec, now, out, outcome=outcome, detail=f"lease {state}")


@handles(ev.ReleaseLease)
def release(core: Core, e: ev.ReleaseLease, now: float, out: list[ev.Command]) -> None:
    lease = core.leases.get(e.lease_id)
    if lease is None:
        raise NotFound(f"lease {e.lease_id!r} not found")
    released = lease.state == "granted"
    if released:
        end_lease(core, lease, now, out, "released")
    if e.token is not None:
        out.append(core.reply(e.token, result={"released": released}))


def expire_leases(core: Core, now: float, out: list[ev.Command]) -> None:
    """A tick: end leases past their TTL and waiting ones past their deadline."""
    for lease in core.leases:
        if lease.state == "granted" and lease.expires_at <= now:
            end_lease(core, lease, now, out, "expired")
        elif (
            lease.state == "waiting" and lease.deadline_at is not None and lease.deadline_at <= now
        ):
            rec = core.actions[lease.action_id]
            core.leases.move(lease, "failed", now, "deadline passed", core.stimulus)
            finish_action(
                core,
                rec,
                now,
                out,
                outcome="timeout",
                detail="lease deadline passed",
                error=("timeout", f"no {lease.api} capacity within the deadline"),
            )
    core.leases.drop_ended()
