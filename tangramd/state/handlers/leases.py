"""API leases: acquire, grant, release, expiry."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from tangram.jobs import DEFAULT_JOB, check_job_name
from tangram.model import ActionId, InvalidDemand, make_action
from tangram.protocol.errors import NotFound, QuotaExceeded, ShuttingDown
from tangramd import events as ev
from tangramd.state.actions import ActionRec
from tangramd.state.dispatch import handles
from tangramd.state.handlers.actions import finish_action
from tangramd.state.leases import LeaseRec
from tangramd.state.story import note

if TYPE_CHECKING:
    from tangramd.state.context import Core


# ---------------------------------------------------------------------- handlers
@handles(ev.AcquireLease)
def acquire(core: Core, e: ev.AcquireLease, now: float, out: list[ev.Command]) -> None:
    if core.shutting_down:
        raise ShuttingDown("daemon is shutting down")
    pool = core.apis.get(e.api)
    if pool is None:
        names = ", ".join(sorted(core.apis)) or "none configured"
        raise NotFound(f"api {e.api!r} not found (configured: {names})")
    job = DEFAULT_JOB if e.job is None else check_job_name(e.job)
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
        job=job,
        seq=core.actions.next_seq(),
        submitted_at=now,
        klass=f"lease/{e.api}",
    )
    core.jobs_seen.add(job)
    deadline = None
    if policy == "deadline":
        deadline = now + (e.deadline_s if e.deadline_s is not None else core.cfg.default_deadline_s)
    ttl = e.ttl_s if e.ttl_s is not None else pool.default_ttl_s
    rec = core.actions.add(action, now, token=e.token, env=None, conn=e.conn)
    note(
        rec,
        now,
        "submitted",
        f"lease api={e.api} ttl={ttl} policy={policy} job={job}",
        core.stimulus,
    )
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


def end_lease(
    core: Core,
    lease: LeaseRec,
    now: float,
    out: list[ev.Command],
    state: Literal["released", "expired"],
) -> None:
    rec = core.actions[lease.action_id]
    core.leases.move(lease, state, now, state, core.stimulus)
    if rec.started_at is not None:
        core.history.observe(rec.action.klass, now - rec.started_at)
    outcome = "ok" if state == "released" else state
    finish_action(core, rec, now, out, outcome=outcome, detail=f"lease {state}")


@handles(ev.ReleaseLease)
def release(core: Core, e: ev.ReleaseLease, now: float, out: list[ev.Command]) -> None:
    """``lease.release``: a granted lease is given back (``released``); one still waiting
    is withdrawn (``withdrawn``: its action leaves the queue, ``cancelled``, and its
    ``lease.acquire`` fails ``not_found``); one that had just ended answers its state and
    ``released`` False."""
    lease = core.leases.get(e.lease_id)
    if lease is None:
        raise NotFound(f"lease {e.lease_id!r} not found")
    released = lease.state in ("granted", "waiting")
    if lease.state == "granted":
        end_lease(core, lease, now, out, "released")
    elif lease.state == "waiting":
        rec = core.actions[lease.action_id]
        core.leases.move(lease, "withdrawn", now, "lease.release before a grant", core.stimulus)
        why = f"lease {lease.action_id} withdrawn by lease.release before it was granted"
        finish_action(
            core, rec, now, out, outcome="cancelled", detail="lease withdrawn",
            error=("not_found", why),
        )  # fmt: skip
    if e.token is not None:
        out.append(core.reply(e.token, result={"released": released, "state": lease.state}))


@handles(ev.RenewLease)
def renew(core: Core, e: ev.RenewLease, now: float, out: list[ev.Command]) -> None:
    """``lease.renew``: a granted lease now expires ``ttl_s`` from now; a waiting one will
    hold for ``ttl_s`` once granted. An ended or unknown lease is not found."""
    lease = core.leases.get(e.lease_id)
    if lease is None or lease.state not in ("waiting", "granted"):
        raise NotFound(f"lease {e.lease_id!r} not found (unknown, released or expired)")
    lease.ttl_s = e.ttl_s
    if lease.state == "granted":
        lease.expires_at = now + e.ttl_s
    rec = core.actions.get(lease.action_id)
    if rec is not None:
        note(rec, now, "renewed", f"ttl={e.ttl_s:g} s from now", core.stimulus)
    if e.token is not None:
        result = {"lease_id": lease.action_id, "ttl_s": e.ttl_s, "state": lease.state}
        out.append(core.reply(e.token, result=result))


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
