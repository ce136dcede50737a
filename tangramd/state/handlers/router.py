"""Events no single book owns: the clock's tick, a client leaving, shutdown."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tangramd import events as ev
from tangramd.state.dispatch import handles
from tangramd.state.handlers.actions import close_env, expire_waits, finish_action
from tangramd.state.handlers.envs import persist_envs
from tangramd.state.handlers.jobs import save_job_stats
from tangramd.state.handlers.leases import end_lease, expire_leases
from tangramd.state.handlers.scheduling import run_pass
from tangramd.state.handlers.services import send_batches

if TYPE_CHECKING:
    from tangramd.state.context import Core


@handles(ev.Tick)
def _tick(core: Core, e: ev.Tick, now: float, out: list[ev.Command]) -> None:
    expire_leases(core, now, out)
    expire_waits(core, now, out)
    send_batches(core, now, out)  # those whose window has passed
    if core.idle_due is None or core.idle_due <= now:  # (else none is due yet)
        for env in core.envs.idle_expired(now):
            close_env(core, env, now, out, "idle TTL expired")
    passer = core.passer
    if passer.windows and passer.windows.due(now):  # an API's quota window opened
        passer.dirty = True
    if (passer.due is not None and now >= passer.due) or passer.dirty:
        run_pass(core, now, out)
    save_job_stats(core, now, out)


@handles(ev.ConnClosed)
def _conn_closed(core: Core, e: ev.ConnClosed, now: float, out: list[ev.Command]) -> None:
    """Waiting work of a dead client is dropped; its leases return at once (never leaked).

    Its queued actions and those waiting for an environment (for memory, too) end
    ``rejected`` ("client gone") and never run; its running execs run to their end (the
    result is dropped). An ``env.open`` still waiting for memory, or being created, is
    closed: nobody would learn its id.
    """
    for rec in core.actions:
        if rec.conn != e.conn or rec.state == "done":
            continue
        rec.token = None
        if rec.action.kind == "api":
            lease = core.leases.get(rec.action.id)
            if lease is not None and lease.state == "granted":
                end_lease(core, lease, now, out, "released")
            elif rec.state == "queued":
                if lease is not None:
                    core.leases.move(lease, "failed", now, "client disconnected", core.stimulus)
                finish_action(core, rec, now, out, outcome="rejected", detail="client gone")
        elif rec.state in ("queued", "waiting_env"):
            finish_action(core, rec, now, out, outcome="rejected", detail="client gone")
    for env in core.envs:
        if env.conn != e.conn:
            continue
        if env.throwaway and env.active == 0:
            close_env(core, env, now, out, "client gone")
        elif not env.throwaway and env.open_token is not None:
            env.open_token = None  # (waiting for memory, or being created)
            close_env(core, env, now, out, "client gone before the environment was ready")


@handles(ev.Shutdown)
def _shutdown(core: Core, e: ev.Shutdown, now: float, out: list[ev.Command]) -> None:
    """Refuse new work, end waiting work, return leases, close throwaway environments.

    Persistent environments belong to their trajectories, not to this process: they are
    kept, their records written, and the next daemon on this state dir re-adopts them.
    A throwaway environment with a running action closes when the action ends
    (``finish_action``); the executor ends running execs through the backend.
    """
    core.shutting_down = True
    send_batches(core, None, out)  # every open one: the host ends them with the rest
    waiting = list(core.actions.queue.values())
    waiting += [r for r in core.actions if r.state == "waiting_env"]
    for rec in waiting:
        finish_action(core, rec, now, out, outcome="rejected", detail="daemon shutting down")
    for lease in core.leases:
        if lease.state == "granted":
            end_lease(core, lease, now, out, "released")
    for env in core.envs:
        if env.throwaway and env.active == 0:
            close_env(core, env, now, out, "daemon shutting down")
        elif not env.throwaway and env.state in ("creating", "waiting_mem"):
            close_env(core, env, now, out, "daemon shutting down before it was ready")
    persist_envs(core, out)
    save_job_stats(core, now, out, force=True)
