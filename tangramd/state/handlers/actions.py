"""Exec actions, and how any action ends (:func:`finish_action`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tangram.jobs import DEFAULT_JOB, check_job_name
from tangram.model import ActionId, TangramError, make_action
from tangram.protocol.errors import BadRequest, EnvLost, InfraError, NotFound, ShuttingDown
from tangram.protocol.results import CallResult, ExecResult, cancelled
from tangramd import events as ev
from tangramd.state.actions import ActionRec, JobCancel, may_touch
from tangramd.state.batches import send_batch
from tangramd.state.dispatch import handles
from tangramd.state.services import gpu_place
from tangramd.state.story import note

if TYPE_CHECKING:
    from tangramd.state.context import Core
    from tangramd.state.envs import EnvRec


# ---------------------------------------------------------------------- how actions end
def finish_action(
    core: Core,
    rec: ActionRec,
    now: float,
    out: list[ev.Command],
    *,
    outcome: str,
    result: ExecResult | None = None,
    detail: str = "",
    error: tuple[str, str] | None = None,
    call: CallResult | None = None,
) -> None:
    """End ``rec`` with ``outcome``: release its units, answer its client, close its
    throwaway environment when it was the last user, and forget the record."""
    if rec.state == "done":
        return
    books = core.actions
    env = core.envs.get(rec.env) if rec.env else None
    if env is not None and rec.action.id in env.pending:
        env.pending.remove(rec.action.id)
    books.unqueue(rec.action.id)
    if rec.spec is not None and rec.spec.session is not None:
        core.sessions.idle(rec.spec.session, rec.action.id)
    if rec.units:
        core.pools[rec.pool_id].release(rec.action.id)
        core.meter.finished(rec.pool_id, rec.action.id)
        core.passer.dirty = True
    for pid, _ in rec.also:  # its units on other pools (joint admission), with them
        core.pools[pid].release(rec.action.id)
    rec.also = ()
    books.move(rec, "done", now, f"{outcome} {detail}".strip(), core.stimulus)
    rec.outcome = outcome
    queue_s = (rec.started_at or now) - rec.submitted_at
    if result is None:
        exec_s = now - rec.started_at if rec.started_at is not None else 0.0
        result = ExecResult(outcome, exec_s=exec_s, detail=detail)  # type: ignore[arg-type]
    books.finished.append((rec.action.kind, queue_s, result.exec_s))
    if rec.started_at is not None:  # its ACT, for the ``jobs`` op's percentiles
        core.job_stats.record(rec.action.job, now - rec.submitted_at, now, core.cfg.jobs)
        if core.shutting_down:  # no later tick writes it: now
            out.append(ev.PersistJobStats(stats=core.job_stats.take(), cause=core.stimulus))
    if env is not None:
        env.active = max(0, env.active - 1)
        env.last_used = now
        if not env.active:  # idle from now on, maybe
            core.idle_from(now)
    if rec.token is not None:
        if error is not None:
            out.append(core.reply(rec.token, error=error))
        elif rec.call is not None:
            ended = call or CallResult(outcome, error=detail)  # type: ignore[arg-type]
            answer = call_answer(core, rec, now, queue_s, ended)
            out.append(core.reply(rec.token, result=answer.to_wire()))
        else:
            final = result.placed(
                action_id=rec.action.id,
                queue_s=queue_s,
                cores=rec.units,
                node=env.node if env else None,
            )
            out.append(core.reply(rec.token, result=final.to_wire()))
        rec.token = None
    for token in rec.cancel_tokens:  # cancels waiting for it to end (a killed exec)
        out.append(core.reply(token, result=cancel_answer(rec.action.id, "done", outcome)))
    rec.cancel_tokens.clear()
    for group in rec.job_cancels:  # cancels of its job waiting for it among others
        aid = rec.action.id
        group.rows[aid] = cancel_answer(aid, "done", outcome)
        group.pending.discard(aid)
        if not group.pending and group.token is not None:
            out.append(core.reply(group.token, result=group.answer()))
    rec.job_cancels.clear()
    if env is not None and env.active == 0 and env.throwaway:
        close_env(core, env, now, out, "throwaway environment done")
    books.forget(rec, outcome)


def close_env(core: Core, env: EnvRec, now: float, out: list[ev.Command], why: str) -> None:
    """Start removing an environment; the actions waiting for it end ``rejected``."""
    for aid in core.envs.close(env, now, out, why, core.stimulus):
        finish_action(core, core.actions[aid], now, out, outcome="rejected", detail=why)


# ---------------------------------------------------------------------- exec handlers
@handles(ev.SubmitExec)
def submit_exec(core: Core, e: ev.SubmitExec, now: float, out: list[ev.Command]) -> None:
    if core.shutting_down:
        raise ShuttingDown("daemon is shutting down")
    spec = e.spec
    core.actions.check_ref(e.conn, spec.ref)
    job = DEFAULT_JOB if spec.job is None else check_job_name(spec.job)
    if spec.api is not None and spec.api not in core.apis:
        names = ", ".join(sorted(core.apis)) or "none"
        raise NotFound(f"api: {spec.api!r} not found (configured: {names})")
    cpus: Any = 1 if spec.cpus is None else spec.cpus
    t1_s, eff = spec.t1_s, spec.eff
    if spec.profile is not None:
        prof = core.profiles.get(spec.profile)
        if prof is None:
            raise NotFound(f"profile {spec.profile!r} not found (see `tangramctl profile --save`)")
        if prof.get("elastic", True):
            t1_s, eff = prof["t1_s"], prof["eff"]
            if spec.cpus is None:
                dops = sorted(int(k) for k in prof["dop"])
                cpus = [dops[0], dops[-1]]
    if isinstance(cpus, tuple):
        cpus = list(cpus)
    session = core.sessions.for_exec(spec.session, spec.env, e.peer) if spec.session else None
    if session is not None:
        env = core.ready_env(session.env, e.peer)
    elif spec.env is not None:
        opened = core.envs.open_env(spec.env, e.peer)
        if opened is None:
            if (lost := core.envs.lost_error(spec.env, e.peer)) is not None:
                raise EnvLost(lost)
            raise NotFound(f"environment {spec.env!r} not found")
        env = opened
        if env.awaiting_node:
            raise InfraError(
                f"environment {env.id}: node {env.node} has not reconnected since the "
                "coordinator restarted; retry"
            )
        if env.lost_node:
            raise EnvLost(
                f"environment {env.id} was lost with node {env.lost_node}; open a new one"
            )
    else:
        env = core.envs.open(
            now,
            out,
            core.stimulus,
            image=spec.image,
            mem=spec.mem,
            trajectory=spec.trajectory,
            throwaway=True,
            token=None,
            conn=e.conn,
            owner=e.peer,
        )
    max_cores = max((p.capacity for p in core.cpu.nodes), default=0)
    aid = ActionId(core.new_id("a"))
    try:
        action = make_action(
            aid,
            "exec",
            env.trajectory,
            {"cpu": cpus} if spec.api is None else {"cpu": cpus, f"api:{spec.api}": 1},
            task=spec.task or "default",
            job=job,
            seq=core.actions.next_seq(),
            t1_s=t1_s,
            eff=eff,
            submitted_at=now,
            klass=f"{spec.task or 'default'}/exec/{command_class(spec.cmd)}",
            capacity={"cpu": max_cores},
        )
    except TangramError:
        if env.throwaway:
            close_env(core, env, now, out, "submission rejected")
        raise
    core.jobs_seen.add(job)
    rec = core.actions.add(
        action,
        now,
        token=e.token,
        env=env.id,
        conn=e.conn,
        spec=spec,
        run_as=e.peer if core.cfg.exec_as_peer else None,
        owner=e.peer,
    )
    if session is not None:
        session.busy = aid  # one command at a time per shell
    wait_s = spec.queue_timeout_s if spec.queue_timeout_s is not None else spec.timeout_s
    if wait_s is not None:  # it gives up waiting then (``expire_waits``)
        core.actions.deadlines.set(aid, now + wait_s)
        rec.bounds_run = spec.queue_timeout_s is None and spec.timeout_s is not None
    note(
        rec,
        now,
        "submitted",
        f"cpus={cpus} env={env.id} job={job}"
        + (f" api={spec.api}" if spec.api is not None else "")
        + f" cmd={short(spec.cmd)}",
        core.stimulus,
    )
    env.active += 1
    env.last_used = now
    if env.state == "ready":
        core.enqueue(rec, now)
    elif env.state == "lost":
        core.envs.recreate(env, now, out, core.stimulus)
        env.pending.append(aid)
        core.actions.move(
            rec, "waiting_env", now, f"environment {env.id} being recreated", core.stimulus
        )
    else:
        env.pending.append(aid)
        why = f"environment {env.id} being created"
        if env.state == "waiting_mem":
            why = f"environment {env.id} waiting for {core.envs.mem_wait(env)}"
        core.actions.move(rec, "waiting_env", now, why, core.stimulus)


@handles(ev.ExecFinished)
def exec_done(core: Core, e: ev.ExecFinished, now: float, out: list[ev.Command]) -> None:
    rec = core.actions.get(e.action_id)
    if rec is None or rec.state != "running":
        return
    res = e.result
    if rec.cancelling:
        res = cancelled(res, "cancelled: killed while running")
    env = core.envs.get(rec.env) if rec.env else None
    if res.outcome == "infra_error" and env is not None and e.env_lost:
        core.envs.lose(env, now, res.detail or "backend lost it", core.stimulus)
    elif res.outcome in ("ok", "failed"):
        core.history.observe(rec.action.klass, res.exec_s)
    finish_action(
        core,
        rec,
        now,
        out,
        outcome=res.outcome,
        result=res,
        detail=f"exit={res.exit_code} exec_s={res.exec_s:.4f} {res.detail}".strip(),
    )


@handles(ev.CancelAction)
def cancel(core: Core, e: ev.CancelAction, now: float, out: list[ev.Command]) -> None:
    """``cancel``: a waiting action ends ``cancelled`` at once; a running exec is killed
    (``KillExec``), a running GPU call's pass stopped (``StopCall``, :func:`_stop_call`),
    and the cancel answered when its end comes back (a batch's rider is detached at once:
    :func:`_detach`); an action that has
    ended is answered with its outcome. Another user's action is not found. With a job:
    every action of it (:func:`cancel_job`)."""
    if e.job is not None:
        cancel_job(core, e, now, out)
        return
    rec = _cancel_target(core, e)
    name = e.action_id if e.action_id is not None else f"with ref {e.ref!r}"
    if rec is None or not may_touch(e.peer, rec.owner):
        outcome = core.actions.ended(e.action_id, e.peer) if e.action_id is not None else None
        if outcome is None:
            raise NotFound(f"action {name} not found (unknown, too old, or not yours)")
        if e.token is not None:
            answer = cancel_answer(e.action_id or "", "done", outcome)
            out.append(core.reply(e.token, result=answer))
        return
    aid = rec.action.id
    if rec.action.kind == "api":
        raise BadRequest(f"id: {aid} is a lease; give it back with lease.release")
    by_owner = e.peer is None or rec.owner is None or e.peer[0] == rec.owner[0]
    who = "its owner" if by_owner else "root"
    if rec.state in ("queued", "waiting_env"):
        finish_action(core, rec, now, out, outcome="cancelled", detail=f"cancelled by {who}")
        if e.token is not None:
            out.append(core.reply(e.token, result=cancel_answer(aid, "done", "cancelled")))
        return
    if rec.action.kind != "exec" and _detach(core, rec, now, out, f"by {who}"):
        if e.token is not None:
            out.append(core.reply(e.token, result=cancel_answer(aid, "done", "cancelled")))
        return
    if e.token is not None:
        rec.cancel_tokens.append(e.token)
    if rec.action.kind == "exec":
        _kill(core, rec, now, out, f"by {who}")
    else:
        _stop_call(core, rec, now, out, f"by {who}")


def cancel_job(core: Core, e: ev.CancelAction, now: float, out: list[ev.Command]) -> None:
    """``cancel`` with job and all: every queued and running exec and call of job
    ``e.job`` that ``e.peer`` owns (every one when ``e.everyone``), in this one event.
    Waiting ones end ``cancelled`` now, running execs are killed and running GPU calls
    stopped (:func:`_stop_call`; a batch's rider is detached); the answer lists each with
    its outcome once the killed and stopped ones have ended. Leases are
    not cancelled (``lease.release`` gives one back)."""
    job = e.job or ""
    group = JobCancel(e.token, job)
    for rec in core.actions:  # (a copy: actions end as it goes)
        if rec.action.job != job or rec.action.kind == "api" or rec.state == "done":
            continue
        if not (e.everyone or may_touch(e.peer, rec.owner)):
            continue
        aid = rec.action.id
        by_owner = e.peer is None or rec.owner is None or e.peer[0] == rec.owner[0]
        who = f"by {'its owner' if by_owner else 'an operator'} (job {job})"
        if rec.state in ("new", "queued", "waiting_env"):
            finish_action(core, rec, now, out, outcome="cancelled", detail=f"cancelled {who}")
            group.rows[aid] = cancel_answer(aid, "done", "cancelled")
            continue
        if rec.action.kind != "exec" and _detach(core, rec, now, out, who):
            group.rows[aid] = cancel_answer(aid, "done", "cancelled")
            continue
        group.rows[aid] = cancel_answer(aid, "running", None)
        group.pending.add(aid)
        rec.job_cancels.append(group)
        if rec.action.kind == "exec":
            _kill(core, rec, now, out, who)
        else:
            _stop_call(core, rec, now, out, who)
    if not group.pending and e.token is not None:
        out.append(core.reply(e.token, result=group.answer()))


def _kill(core: Core, rec: ActionRec, now: float, out: list[ev.Command], who: str) -> None:
    """Kill a running exec (``KillExec``); its end comes back as ``ExecFinished``."""
    if rec.cancelling:
        return  # already being killed: answered with the first cancel
    rec.cancelling = True
    aid = rec.action.id
    env = core.envs.get(rec.env) if rec.env else None
    note(rec, now, "cancel", f"{who}: killing it", core.stimulus)
    out.append(
        ev.KillExec(
            action_id=aid,
            node=env.node if env is not None else "",
            session=rec.spec.session if rec.spec is not None else None,
            cause=core.stimulus,
        )
    )


def _detach(core: Core, rec: ActionRec, now: float, out: list[ev.Command], who: str) -> bool:
    """A running call that rides another's forward pass (a batch's rider, holding no
    GPUs) ends ``cancelled`` now; the pass runs on for the others and its answer for
    this call is dropped. False for a call that holds its GPUs (the pass's leader)."""
    batch = core.services.riding.pop(rec.action.id, None)
    if batch is None:
        return False
    for batches in core.services.forming.values():  # (not sent yet: not sent with it)
        for forming in batches:
            if rec in forming.riders:
                forming.riders.remove(rec)
    why = f"cancelled {who}: detached from its batch's forward pass, which runs on"
    note(rec, now, "cancel", why, core.stimulus)
    finish_action(core, rec, now, out, outcome="cancelled", detail=why)
    return True


def _stop_call(core: Core, rec: ActionRec, now: float, out: list[ev.Command], who: str) -> None:
    """Stop a running GPU call (``StopCall``): the replica's workers are killed, the
    call and its pass's riders end ``cancelled`` when their ``CallFinished`` comes back,
    and only then are its GPUs released. A call whose pass is still forming (its batch
    window) is sent now, with its riders, so that the host has it to stop."""
    if rec.cancelling:
        return  # already being stopped: answered with the first cancel
    assert core.gpu is not None and rec.call is not None, "running calls hold GPUs"
    rec.cancelling = True
    node, local = gpu_place(core.gpu, rec.units)
    for name, batches in list(core.services.forming.items()):
        for batch in [b for b in batches if b.leader is rec]:
            batches.remove(batch)
            send_batch(core, batch, out)
        if not batches:
            del core.services.forming[name]
    riders = [aid for aid, place in core.services.riding.items() if place == (node, local)]
    for aid in riders:  # (they end with it: its pass is stopped)
        rider = core.actions[aid]
        rider.cancelling = True
        note(rider, now, "cancel", f"its pass's leader {rec.action.id} is stopped", core.stimulus)
    note(rec, now, "cancel", f"{who}: stopping its forward pass", core.stimulus)
    out.append(ev.StopCall(action_id=rec.action.id, node=node, cause=core.stimulus))


def _cancel_target(core: Core, e: ev.CancelAction) -> ActionRec | None:
    if e.action_id is not None:
        return core.actions.get(e.action_id)
    return core.actions.by_ref(e.conn, e.ref)


def cancel_answer(action_id: str, state: str, outcome: str | None) -> dict[str, Any]:
    """The ``cancel`` op's result."""
    return {
        "action_id": action_id,
        "cancelled": outcome == "cancelled",
        "state": state,
        "outcome": outcome,
    }


def run_exec(core: Core, rec: ActionRec, out: list[ev.Command]) -> None:
    """The placed exec goes to the backend of its environment's node."""
    env = core.envs.get(rec.env) if rec.env else None
    spec = rec.spec
    assert env is not None and spec is not None, "exec actions have an env and a spec"
    waited = (rec.started_at or rec.submitted_at) - rec.submitted_at
    if rec.bounds_run and spec.timeout_s is not None and waited > 0:
        # its timeout bounds queueing plus execution: the command gets what is left
        # (more than nothing: the wait's deadline had not passed when it was placed)
        spec = replace(spec, timeout_s=max(spec.timeout_s - waited, 1e-3))
    out.append(
        ev.RunExec(
            action_id=rec.action.id,
            env_id=env.id,
            node=env.node,
            cores=tuple(rec.units),
            spec=spec,
            max_output=core.cfg.max_output,
            run_as=rec.run_as,
            cause=core.stimulus,
        )
    )


def expire_waits(core: Core, now: float, out: list[ev.Command]) -> None:
    """End the actions whose wait passed its deadline ``timeout``, and fail the
    ``env.open`` requests whose wait for memory did, naming what they waited for."""
    for aid in core.actions.deadlines.due(now):
        rec = core.actions.get(aid)
        if rec is None or rec.state not in ("queued", "waiting_env"):
            continue
        waited = now - rec.submitted_at
        why = f"waited {waited:.1f} s for {waiting_for(core, rec)}"
        finish_action(core, rec, now, out, outcome="timeout", detail=why)
    for env in core.envs.give_up_waiting(now):
        token, env.open_token = env.open_token, None
        why = f"waited {now - env.created_at:.1f} s for {core.envs.mem_wait(env)}"
        if token is not None:
            out.append(core.reply(token, error=("timeout", why)))
        close_env(core, env, now, out, f"env.open timed out: {why}")


def waiting_for(core: Core, rec: ActionRec) -> str:
    """What a waiting action waits for: ``memory: needs 1 GiB, 0.3 GiB free`` (its
    environment's), ``environment e3 to be created``, ``cpu: needs 2, free 0 ...``."""
    env = core.envs.get(rec.env) if rec.env else None
    if rec.state == "waiting_env" and env is not None:
        if env.state == "waiting_mem":
            return core.envs.mem_wait(env)
        return f"environment {env.id} to be {'recreated' if env.state == 'lost' else 'created'}"
    action = rec.action
    for pid, need in action.extra:  # joint admission: the other pool it waits for first
        pool = core.apis.get(pid[4:])
        if pool is not None and pool.free_units() < need:
            if pool.concurrency and pool.concurrency_left() < need:
                held = f"{pool.in_use} of {pool.concurrency} slots held"
            else:
                held = f"quota of {pool.quota} per {pool.period_s:g} s used"
            return f"api {pool.name}: {held}"
    if action.kind == "exec" and env is not None and env.node:
        pool = core.pools.get(f"cpu:{env.node}")
        if pool is not None:
            return f"cores: needs {action.min_units}, {pool.free_units()} free on {env.node}"
    if action.kind == "api":
        return f"a unit of API {action.api!r}"
    if action.kind == "service":
        return "GPUs"
    return "its units"


# ---------------------------------------------------------------------- helpers
def cmd_text(cmd: str | Sequence[str]) -> str:
    return cmd if isinstance(cmd, str) else " ".join(str(c) for c in cmd)


def command_class(cmd: str | Sequence[str]) -> str:
    """History class of a command: its program name (``pytest`` for pytest runs)."""
    words = cmd_text(cmd).split()
    for w in words:
        if "pytest" in w or w == "py.test":
            return "pytest"
    return words[0].rsplit("/", 1)[-1] if words else "?"


def short(cmd: str | Sequence[str], limit: int = 80) -> str:
    text = cmd_text(cmd)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def call_answer(
    core: Core, rec: ActionRec, now: float, queue_s: float, call: CallResult
) -> CallResult:
    # (a batch's rider holds no GPUs: its answer names the leader's, as ``call`` gave them)
    node, local = gpu_place(core.gpu, rec.units) if rec.units else (call.node, call.gpus)
    return replace(
        call,
        queue_s=queue_s,
        act_s=now - rec.submitted_at,
        gpus=local,
        node=node,
        action_id=rec.action.id,
    )
