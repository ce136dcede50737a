"""The daemon's state machine: queues, environments, leases and the scheduler.

One entry point, ``Core.handle(event, now) -> list[Command]``: state changes only there.
The executor (``tangramd.runtime``) runs the commands (backend I/O, replies to clients) and
feeds each result back as a new event. ``now`` is always an argument; the core never awaits,
sleeps or reads the clock, so tests drive it synchronously.

In ``tangramd up`` this one core is both the coordinator (queues, registry, global
scheduler) and the node's bookkeeping (environments on its backend): the all-in-one mode.

Scheduling passes are coalesced: arrivals and completions only mark the core *dirty*; the
executor calls ``Tick`` at most once per ``coalesce_s`` window, so a flood of tiny actions is
scheduled in batches rather than one pass per event.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tangram.model import (
    ActionId,
    EnvId,
    HistoryEstimator,
    InvalidDemand,
    TangramError,
    make_action,
)
from tangram.pools.api import ApiPool
from tangram.pools.cpu import CpuCluster
from tangram.protocol.errors import NotFound, QuotaExceeded, ShuttingDown
from tangram.sched import SchedConfig, Snapshot, schedule
from tangramd import events as ev
from tangramd.entities import (
    ACTION_EDGES,
    ENV_EDGES,
    LEASE_EDGES,
    ActionRec,
    EnvRec,
    Story,
    transition,
)
from tangramd.envbook import EnvBook, on_close, on_env_created, on_env_removed, on_open

STORY_LIMIT = 10_000  # actions whose story is kept after they end


@dataclass
class CoreConfig:
    sched: SchedConfig = field(default_factory=SchedConfig)
    coalesce_s: float = 0.001
    default_env_mem: int = 1 << 30
    env_idle_ttl_s: float = 1800.0
    default_lease_ttl_s: float = 60.0
    default_deadline_s: float = 30.0
    max_output: int = 1 << 20
    default_image: str | None = None


@dataclass
class LeaseRec:
    action_id: ActionId
    api: str
    ttl_s: float
    policy: str
    deadline_at: float | None
    state: str = "waiting"  # waiting -> granted -> released | expired; waiting -> failed
    expires_at: float = math.inf
    conn: int | None = None


class Core(EnvBook):
    """Coordinator + node bookkeeping of ``tangramd up`` (see module doc)."""

    def __init__(
        self,
        cpu: CpuCluster,
        apis: Mapping[str, ApiPool],
        config: CoreConfig | None = None,
        history: HistoryEstimator | None = None,
    ) -> None:
        self.cfg = config or CoreConfig()
        self.cpu = cpu
        self.apis = dict(apis)
        self.history = history or HistoryEstimator(default_s=1.0)
        self.pools: dict[str, Any] = {p.pool_id: p for p in cpu.nodes}
        self.pools.update({p.pool_id: p for p in self.apis.values()})
        self.actions: dict[ActionId, ActionRec] = {}  # live actions only
        self.recent: OrderedDict[ActionId, str] = OrderedDict()  # outcome of ended ones
        self.queue: dict[ActionId, ActionRec] = {}  # waiting for units, FCFS (seq) order
        self.envs: dict[EnvId, EnvRec] = {}
        self.env_waitq: deque[EnvId] = deque()  # environments waiting for memory, FIFO
        self.leases: dict[ActionId, LeaseRec] = {}
        self.profiles: dict[str, dict[str, Any]] = {}
        self.stories = Story(STORY_LIMIT)
        self._seq = itertools.count(1)
        self._ids = itertools.count(1)
        self._dirty = False
        self._pass_due: float | None = None
        self.shutting_down = False
        self.passes = 0
        self.finished: deque[tuple[str, float, float]] = deque(maxlen=4096)  # kind, queue, exec

    # ------------------------------------------------------------------ entry point
    def handle(self, event: ev.Event, now: float) -> list[ev.Command]:
        out: list[ev.Command] = []
        handler = _HANDLERS[type(event)]
        try:
            handler(self, event, now, out)
        except TangramError as exc:
            token = getattr(event, "token", None)
            if token is None:
                raise
            out.append(ev.Reply(token, error=(exc.code, exc.message), cause=event.cause))
        if self._dirty and self._pass_due is None:
            self._pass_due = now + self.cfg.coalesce_s
        return out

    def next_wakeup(self, now: float) -> float | None:
        """Earliest time the executor must feed a ``Tick``."""
        times = [t for t in (self._pass_due,) if t is not None]
        times += [lease.expires_at for lease in self.leases.values() if lease.state == "granted"]
        times += [
            lease.deadline_at
            for lease in self.leases.values()
            if lease.state == "waiting" and lease.deadline_at is not None
        ]
        for env in self.envs.values():
            if env.state == "ready" and not env.active:
                times.append(env.last_used + self.cfg.env_idle_ttl_s)
        if any(rec.action.kind == "api" for rec in self.queue.values()):
            for pool in self.apis.values():
                t = pool.next_grant_time(now)
                if t is not None:
                    times.append(t)
        return min(times) if times else None

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):x}"

    # ------------------------------------------------------------------ actions
    def _submit_exec(self, e: ev.SubmitExec, now: float, out: list[ev.Command]) -> None:
        if self.shutting_down:
            raise ShuttingDown("daemon is shutting down")
        cpus: Any = 1 if e.cpus is None else e.cpus
        t1_s, eff, elastic = e.t1_s, e.eff, e.elastic
        if e.profile is not None:
            prof = self.profiles.get(e.profile)
            if prof is None:
                raise NotFound(f"profile {e.profile!r} not found (see `tangramctl profile --save`)")
            if prof.get("elastic", True):
                t1_s, eff = prof["t1_s"], prof["eff"]
                if e.cpus is None:
                    dops = sorted(int(k) for k in prof["dop"])
                    cpus = [dops[0], dops[-1]]
        if e.env is not None:
            env = self.envs.get(EnvId(e.env))
            if env is None or env.state in ("closing", "closed"):
                raise NotFound(f"environment {e.env!r} not found")
        else:
            env = self._open_env(
                now,
                out,
                image=e.image,
                mem=e.mem,
                trajectory=e.trajectory,
                throwaway=True,
                token=None,
                cause=e.cause,
                conn=e.conn,
            )
        max_cores = max(p.capacity for p in self.cpu.nodes)
        aid = ActionId(self._new_id("a"))
        try:
            action = make_action(
                aid,
                "exec",
                env.trajectory,
                {"cpu": cpus},
                task=e.task or "default",
                seq=next(self._seq),
                t1_s=t1_s,
                eff=eff,
                submitted_at=now,
                klass=f"{e.task or 'default'}/exec/{_command_class(e.cmd)}",
                capacity={"cpu": max_cores},
            )
        except TangramError:
            if env.throwaway:
                self._close_env(env, now, out, "submission rejected")
            raise
        rec = ActionRec(
            action=action,
            token=e.token,
            env=env.id,
            conn=e.conn,
            submitted_at=now,
            request={
                "cmd": e.cmd,
                "timeout_s": e.timeout_s,
                "env_vars": e.env_vars or {},
                "elastic": elastic is not False,
            },
        )
        self.actions[aid] = rec
        self.stories.add(aid, now, "submitted", f"cpus={cpus} env={env.id} cmd={_short(e.cmd)}")
        env.active += 1
        env.last_used = now
        if env.state == "ready":
            self._enqueue(rec, now)
        elif env.state == "lost":
            transition(env, "creating", ENV_EDGES, now, "next action recreates a lost env")
            out.append(ev.CreateEnv(env.id, env.node, env.image, env.mem, cause=e.cause))
            env.pending.append(aid)
            transition(rec, "waiting_env", ACTION_EDGES, now, "environment being recreated")
        else:
            env.pending.append(aid)
            transition(rec, "waiting_env", ACTION_EDGES, now, "environment being created")

    def _enqueue(self, rec: ActionRec, now: float) -> None:
        transition(rec, "queued", ACTION_EDGES, now, "ready to schedule")
        self.queue[rec.action.id] = rec
        self._dirty = True

    def _finish_action(
        self,
        rec: ActionRec,
        now: float,
        out: list[ev.Command],
        *,
        outcome: str,
        result: Mapping[str, Any] | None = None,
        detail: str = "",
        error: tuple[str, str] | None = None,
    ) -> None:
        if rec.state == "done":
            return
        self.queue.pop(rec.action.id, None)
        if rec.units:
            self.pools[rec.pool_id].release(rec.action.id)
            self._dirty = True
        transition(rec, "done", ACTION_EDGES, now, f"{outcome} {detail}".strip())
        rec.outcome = outcome
        rec.finished_at = now
        queue_s = (rec.started_at or now) - rec.submitted_at
        exec_s = float(result.get("exec_s", 0.0)) if result else 0.0
        if rec.started_at is not None and not result:
            exec_s = now - rec.started_at
        self.finished.append((rec.action.kind, queue_s, exec_s))
        env = self.envs.get(rec.env) if rec.env else None
        if env is not None:
            env.active = max(0, env.active - 1)
            env.last_used = now
        if rec.token is not None:
            if error is not None:
                out.append(ev.Reply(rec.token, error=error, cause=0))
            else:
                payload = {
                    "action_id": rec.action.id,
                    "outcome": outcome,
                    "exit_code": None,
                    "stdout": "",
                    "stderr": "",
                    "truncated": False,
                    "detail": detail,
                    **(dict(result) if result else {}),
                    "queue_s": queue_s,
                    "exec_s": exec_s,
                    "act_s": queue_s + exec_s,
                    "cores": list(rec.units),
                    "node": env.node if env else None,
                }
                out.append(ev.Reply(rec.token, result=payload, cause=0))
            rec.token = None
        if env is not None and env.throwaway and env.active == 0:
            self._close_env(env, now, out, "throwaway environment done")
        # forget the record (the story keeps what happened), bounded memory for long runs
        self.actions.pop(rec.action.id, None)
        self.recent[rec.action.id] = outcome
        if len(self.recent) > STORY_LIMIT:
            self.recent.popitem(last=False)

    # ------------------------------------------------------------------ scheduling
    def run_pass(self, now: float, out: list[ev.Command]) -> None:
        self._pass_due = None
        self._dirty = False
        if not self.queue:
            return
        for pool in self.apis.values():
            pool.advance(now)
        running: dict[str, list[tuple[float, int]]] = {}
        for rec in self.actions.values():
            if rec.state == "running" and rec.pool_id:
                started = rec.started_at if rec.started_at is not None else now
                exp = started + rec.expected_s
                if exp <= now:  # overdue: expect it to run about as long again as it has
                    exp = now + (now - started)
                running.setdefault(rec.pool_id, []).append((exp, len(rec.units) or 1))
        affinity = {env.trajectory: f"cpu:{env.node}" for env in self.envs.values() if env.node}
        snap = Snapshot(
            waiting=[rec.action for rec in self.queue.values()],
            pools=self.pools,
            affinity=affinity,
            running=running,
            estimate=self.history.estimate,
        )
        decision = schedule(snap, now, self.cfg.sched)
        self.passes += 1
        for inf in decision.infeasible:
            rec = self.actions[inf.action_id]
            self.stories.add(rec.action.id, now, "infeasible", inf.shortfall.describe())
            self._finish_action(
                rec,
                now,
                out,
                outcome="rejected",
                error=("unschedulable", inf.shortfall.describe()),
            )
        for p in decision.placements:
            rec = self.queue.pop(p.action_id)
            pool = self.pools[p.pool_id]
            pool.allocate(p.action_id, p.units)
            rec.pool_id = p.pool_id
            rec.units = p.units
            rec.started_at = now
            rec.expected_s = p.expected_s
            transition(rec, "running", ACTION_EDGES, now, f"placed on {p.pool_id} units={p.units}")
            if rec.action.kind == "exec":
                self._start_exec(rec, now, out)
            else:
                self._grant_lease(rec, now, out)

    def _start_exec(self, rec: ActionRec, now: float, out: list[ev.Command]) -> None:
        env = self.envs[rec.env]  # type: ignore[index]  # exec actions always have an env
        req = rec.request
        out.append(
            ev.RunExec(
                action_id=rec.action.id,
                env_id=env.id,
                node=env.node,
                cores=tuple(rec.units),
                cmd=req["cmd"],
                timeout_s=req["timeout_s"],
                elastic=req["elastic"],
                env_vars=dict(req["env_vars"]),
                max_output=self.cfg.max_output,
                cause=0,
            )
        )

    def _exec_done(self, e: ev.ExecFinished, now: float, out: list[ev.Command]) -> None:
        rec = self.actions.get(ActionId(e.action_id))
        if rec is None or rec.state != "running":
            return
        res = e.result
        env = self.envs.get(rec.env) if rec.env else None
        if res["outcome"] == "infra_error" and env is not None and e.env_lost:
            if env.state == "ready":
                transition(env, "lost", ENV_EDGES, now, res.get("detail", "backend lost it"))
        elif res["outcome"] in ("ok", "failed"):
            self.history.observe(rec.action.klass, float(res.get("exec_s", 0.0)))
        self.stories.add(
            rec.action.id,
            now,
            "finished",
            f"outcome={res['outcome']} exit={res.get('exit_code')} "
            f"exec_s={res.get('exec_s', 0):.4f}",
        )
        self._finish_action(
            rec, now, out, outcome=res["outcome"], result=res, detail=res.get("detail", "")
        )

    # ------------------------------------------------------------------ leases
    def _acquire(self, e: ev.AcquireLease, now: float, out: list[ev.Command]) -> None:
        if self.shutting_down:
            raise ShuttingDown("daemon is shutting down")
        pool = self.apis.get(e.api)
        if pool is None:
            names = ", ".join(sorted(self.apis)) or "none configured"
            raise NotFound(f"api {e.api!r} not found (configured: {names})")
        policy = e.policy or pool.overflow
        if policy not in ("wait", "reject", "deadline"):
            raise InvalidDemand("policy", f"unknown policy {policy!r}", "wait, reject, deadline")
        if policy == "reject":
            pool.advance(now)
            busy = any(r.action.key == pool.resource for r in self.queue.values())
            if busy or pool.free_units() < 1:
                raise QuotaExceeded(f"api {e.api!r}: no capacity now (policy reject)")
        aid = ActionId(self._new_id("l"))
        action = make_action(
            aid,
            "api",
            f"lease-{aid}",
            {pool.resource: 1},
            seq=next(self._seq),
            submitted_at=now,
            klass=f"lease/{e.api}",
        )
        deadline = None
        if policy == "deadline":
            deadline = now + (
                e.deadline_s if e.deadline_s is not None else self.cfg.default_deadline_s
            )
        ttl = e.ttl_s if e.ttl_s is not None else pool.default_ttl_s
        rec = ActionRec(action=action, token=e.token, env=None, conn=e.conn, submitted_at=now)
        self.actions[aid] = rec
        self.leases[aid] = LeaseRec(aid, e.api, ttl, policy, deadline, conn=e.conn)
        self.stories.add(aid, now, "submitted", f"lease api={e.api} ttl={ttl} policy={policy}")
        self._enqueue(rec, now)

    def _grant_lease(self, rec: ActionRec, now: float, out: list[ev.Command]) -> None:
        lease = self.leases[rec.action.id]
        transition(lease, "granted", LEASE_EDGES, now, "capacity granted")
        lease.expires_at = now + lease.ttl_s
        if rec.token is not None:
            out.append(
                ev.Reply(
                    rec.token,
                    result={
                        "lease_id": rec.action.id,
                        "api": lease.api,
                        "expires_in_s": lease.ttl_s,
                        "queue_s": now - rec.submitted_at,
                    },
                    cause=0,
                )
            )
            rec.token = None

    def _end_lease(self, lease: LeaseRec, now: float, out: list[ev.Command], state: str) -> None:
        rec = self.actions[lease.action_id]
        transition(lease, state, LEASE_EDGES, now, state)
        if rec.started_at is not None:
            self.history.observe(rec.action.klass, now - rec.started_at)
        self._finish_action(rec, now, out, outcome="ok" if state == "released" else state)

    def _release(self, e: ev.ReleaseLease, now: float, out: list[ev.Command]) -> None:
        lease = self.leases.get(ActionId(e.lease_id))
        if lease is None:
            raise NotFound(f"lease {e.lease_id!r} not found")
        released = lease.state == "granted"
        if released:
            self._end_lease(lease, now, out, "released")
        if e.token is not None:
            out.append(ev.Reply(e.token, result={"released": released}, cause=e.cause))

    # ------------------------------------------------------------------ ticks
    def _tick(self, now: float, out: list[ev.Command]) -> None:
        for lease in list(self.leases.values()):
            if lease.state == "granted" and lease.expires_at <= now:
                self.stories.add(lease.action_id, now, "lease_expired", f"ttl={lease.ttl_s}")
                self._end_lease(lease, now, out, "expired")
            elif (
                lease.state == "waiting"
                and lease.deadline_at is not None
                and lease.deadline_at <= now
            ):
                rec = self.actions[lease.action_id]
                transition(lease, "failed", LEASE_EDGES, now, "deadline passed")
                self._finish_action(
                    rec,
                    now,
                    out,
                    outcome="timeout",
                    error=("timeout", f"no {lease.api} capacity within the deadline"),
                )
        for lease_id in [
            k for k, v in self.leases.items() if v.state in ("released", "expired", "failed")
        ]:
            del self.leases[lease_id]
        for env in list(self.envs.values()):
            if (
                env.state == "ready"
                and not env.active
                and now - env.last_used >= self.cfg.env_idle_ttl_s
            ):
                self._close_env(env, now, out, "idle TTL expired")
        if (self._pass_due is not None and now >= self._pass_due) or self._dirty:
            self.run_pass(now, out)

    # ------------------------------------------------------------------ views
    def trajectory_of(self, action_id: str) -> str | None:
        rec = self.actions.get(ActionId(action_id))
        return rec.action.trajectory if rec else None

    def status(self, now: float) -> dict[str, Any]:
        running = sum(1 for r in self.actions.values() if r.state == "running")
        return {
            "queued": len(self.queue),
            "running": running,
            "environments": sum(1 for e in self.envs.values() if e.state != "closed"),
            "leases": sum(1 for lease in self.leases.values() if lease.state == "granted"),
            "passes": self.passes,
            "recent": _recent_summary(self.finished),
            "pools": {
                pid: {"capacity": p.capacity, "free": p.free_units()}
                for pid, p in self.pools.items()
            },
        }

    def validate(self) -> None:
        """Invariants every test checks at teardown."""
        for node in self.cpu.nodes:
            node.validate()
        holders: dict[int, ActionId] = {}
        for rec in self.actions.values():
            if rec.state == "running" and rec.action.kind == "exec":
                for core in rec.units:
                    assert core not in holders, (
                        f"core {core} held by {holders[core]} and {rec.action.id}"
                    )
                    holders[core] = rec.action.id
            assert rec.state != "done", f"ended action {rec.action.id} still live"
        for aid in self.queue:
            assert self.actions[aid].state == "queued"
        for pool in self.apis.values():
            assert pool.free_units() >= 0


def _recent_summary(finished: deque[tuple[str, float, float]]) -> dict[str, dict[str, float]]:
    """Mean queue / exec / ACT seconds per action kind over the recent finished actions."""
    acc: dict[str, list[float]] = {}
    for kind, queue_s, exec_s in finished:
        row = acc.setdefault(kind, [0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += queue_s
        row[2] += exec_s
    return {
        kind: {"count": n, "queue_s": q / n, "exec_s": x / n, "act_s": (q + x) / n}
        for kind, (n, q, x) in acc.items()
    }


def _cmd_text(cmd: str | Sequence[str]) -> str:
    return cmd if isinstance(cmd, str) else " ".join(str(c) for c in cmd)


def _command_class(cmd: str | Sequence[str]) -> str:
    """History class of a command: its program name (``pytest`` for pytest runs)."""
    words = _cmd_text(cmd).split()
    for w in words:
        if "pytest" in w or w == "py.test":
            return "pytest"
    return words[0].rsplit("/", 1)[-1] if words else "?"


def _short(cmd: str | Sequence[str], limit: int = 80) -> str:
    text = _cmd_text(cmd)
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---------------------------------------------------------------------- event dispatch


def _on_conn_closed(core: Core, e: ev.ConnClosed, now: float, out: list[ev.Command]) -> None:
    # Waiting work of a dead client is dropped; its leases return at once (never leaked).
    for rec in list(core.actions.values()):
        if rec.conn != e.conn or rec.state == "done":
            continue
        rec.token = None
        if rec.action.kind == "api":
            lease = core.leases.get(rec.action.id)
            if lease is not None and lease.state == "granted":
                core._end_lease(lease, now, out, "released")
            elif rec.state == "queued":
                if lease is not None:
                    transition(lease, "failed", LEASE_EDGES, now, "client disconnected")
                core._finish_action(rec, now, out, outcome="rejected", detail="client gone")
        elif rec.state in ("queued", "waiting_env"):
            core._finish_action(rec, now, out, outcome="rejected", detail="client gone")
    for env in list(core.envs.values()):
        if env.throwaway and env.conn == e.conn and env.active == 0:
            core._close_env(env, now, out, "client gone")


def _on_shutdown(core: Core, e: ev.Shutdown, now: float, out: list[ev.Command]) -> None:
    core.shutting_down = True
    for rec in list(core.queue.values()) + [
        r for r in core.actions.values() if r.state == "waiting_env"
    ]:
        core._finish_action(rec, now, out, outcome="rejected", detail="daemon shutting down")
    for lease in list(core.leases.values()):
        if lease.state == "granted":
            core._end_lease(lease, now, out, "released")


_HANDLERS: dict[type, Any] = {
    ev.SubmitExec: lambda c, e, now, out: c._submit_exec(e, now, out),
    ev.OpenEnv: on_open,
    ev.CloseEnv: on_close,
    ev.EnvCreated: on_env_created,
    ev.EnvRemoved: on_env_removed,
    ev.ExecFinished: lambda c, e, now, out: c._exec_done(e, now, out),
    ev.AcquireLease: lambda c, e, now, out: c._acquire(e, now, out),
    ev.ReleaseLease: lambda c, e, now, out: c._release(e, now, out),
    ev.ConnClosed: _on_conn_closed,
    ev.Tick: lambda c, e, now, out: c._tick(now, out),
    ev.Shutdown: _on_shutdown,
}
