"""The daemon's state machine: actions, queues, leases, profiles and the scheduler.

One entry point, ``Core.handle(event, now) -> list[Command]``: state changes only there.
The executor (``tangramd.executor``) runs the commands (backend I/O, replies to clients,
writing profiles) and feeds each result back as a new event. ``now`` is always an argument;
the core never awaits, sleeps or reads the clock, so tests drive it synchronously. Each
``handle`` call gets a stimulus id that every command it produces carries as ``cause`` and
every story entry records.

Views (status, queue, stories, profiles, APIs, environments) are read-model methods here:
the op handlers read through them and never touch the core's fields.

In ``tangramd up`` this one core is both the coordinator (queues, registry, global
scheduler) and, through its :class:`~tangramd.envbook.EnvBook`, the node's bookkeeping of
environments: the all-in-one mode.

Scheduling passes are coalesced: arrivals and completions only mark the core *dirty*, and
a pass is due at once when none ran in the last ``coalesce_s`` (0 by default: always),
else at the end of that window. The executor decides when a due pass runs: at the end of
the event loop's turn (every event read in that turn shares it), or at once after a
completion (see ``Executor._arm_timer``).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tangram.model import (
    Action,
    ActionId,
    HistoryEstimator,
    InvalidDemand,
    TangramError,
    TrajectoryId,
    make_action,
)
from tangram.pools.api import ApiPool
from tangram.pools.cpu import CpuCluster, CpuNodePool
from tangram.pools.gpu import GpuCluster
from tangram.protocol.errors import (
    BadRequest,
    EnvLost,
    InfraError,
    NotFound,
    QuotaExceeded,
    ShuttingDown,
)
from tangram.protocol.results import CallResult, ExecResult
from tangram.sched import Decision, Infeasible, LoadMeter, SchedConfig, Snapshot, schedule
from tangramd import events as ev
from tangramd.entities import (
    ACTION_EDGES,
    LEASE_EDGES,
    SESSION_EDGES,
    ActionRec,
    EnvRec,
    Placed,
    SessionRec,
    Stories,
    note,
    transition,
)
from tangramd.envbook import EnvBook, EnvDefaults, Failed, Ready
from tangramd.services.spec import ServiceSpec, SpecError

STORY_LIMIT = 10_000  # actions whose story is kept after they end


@dataclass
class CoreConfig:
    sched: SchedConfig = field(default_factory=SchedConfig)
    coalesce_s: float = 0.0
    default_env_mem: int = 1 << 30
    env_idle_ttl_s: float = 1800.0
    default_lease_ttl_s: float = 60.0
    default_deadline_s: float = 30.0
    max_output: int = 1 << 20
    default_image: str | None = None
    exec_as_peer: bool = False  # commands run as the connecting client (cpu.exec_user="peer")
    # emit RecordEnv / PersistEnvs (tangramd up; a coordinator keeps its own registry)
    record_envs: bool = True
    max_transfer: int = 8 << 20  # bytes one env.get may return (env.put: the op table's cap)
    call_timeout_s: float = 300.0  # a service call's handler limit when the call gives none
    # Short-cut passes that provably decide what the full pass would (``Core._short_waiting``);
    # False: every pass reads the whole queue (tests compare the two).
    short_passes: bool = True


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
    history: deque[tuple[float, str, str, str]] = field(default_factory=lambda: deque(maxlen=8))


class Core:
    """Coordinator + node bookkeeping of ``tangramd up`` (see module doc)."""

    def __init__(
        self,
        cpu: CpuCluster,
        apis: Mapping[str, ApiPool],
        config: CoreConfig | None = None,
        history: HistoryEstimator | None = None,
        gpu: GpuCluster | None = None,
    ) -> None:
        self.cfg = config or CoreConfig()
        self.cpu = cpu
        self.apis = dict(apis)
        self.envs = EnvBook(
            cpu,
            EnvDefaults(
                mem=self.cfg.default_env_mem,
                image=self.cfg.default_image,
                idle_ttl_s=self.cfg.env_idle_ttl_s,
                owned_by_peer=self.cfg.exec_as_peer,
            ),
        )
        self.history = history or HistoryEstimator(default_s=1.0)
        self.pools: dict[str, Any] = {p.pool_id: p for p in cpu.nodes}
        self.pools.update({p.pool_id: p for p in self.apis.values()})
        # GPU services (docs/design.md §5.3): the `gpu` pool, the services loaded on the nodes, and
        # the registrations / removals the service host is carrying out.
        self.gpu = gpu
        if gpu is not None:
            self.pools[gpu.pool_id] = gpu
        self.services: dict[str, ServiceSpec] = {}
        self._registering: dict[str, int | None] = {}  # name -> token of the request
        self._removing: dict[str, tuple[int | None, int]] = {}  # name -> (token, rejected)
        self._gpu_tick = 0  # LRU clock of the GPU residency
        self.actions: dict[ActionId, ActionRec] = {}  # live actions only
        self.recent: OrderedDict[ActionId, str] = OrderedDict()  # outcome of ended ones
        self.queue: dict[ActionId, ActionRec] = {}  # waiting for units, FCFS (seq) order
        self.leases: dict[ActionId, LeaseRec] = {}
        self.profiles: dict[str, dict[str, Any]] = {}
        self.stories = Stories(STORY_LIMIT)
        self.meter = LoadMeter()  # recent offered load per CPU node (the "priced" rule)
        self._seq = itertools.count(1)
        self._ids = itertools.count(1)
        self._stimuli = itertools.count(1)
        self.stimulus = 0  # id of the event being handled
        self._dirty = False
        self._pass_due: float | None = None
        self._last_pass = -math.inf
        self.shutting_down = False
        self.passes = 0
        self.finished: deque[tuple[str, float, float]] = deque(maxlen=4096)  # kind, queue, exec
        self.sessions: dict[str, SessionRec] = {}
        # What the short-cut pass relies on (``_short_waiting``): actions queued since the
        # last pass (insertion order), and the affinity and pools that pass saw.
        self._fresh: dict[ActionId, None] = {}
        self._seen_affinity: dict[TrajectoryId, str] | None = None
        self._seen_pools: tuple[tuple[str, int], ...] = ()
        self._seen_plain = False  # every action that pass left queued: an exec with a node
        self.passes_short = 0  # passes that read only a prefix of the queue
        self.passes_full_pools = 0  # short passes with no free core: no scheduler run
        # next_wakeup's shortcuts: queued API actions, and a lower bound of the earliest
        # idle deadline (None: scan the environments; see ``handle``)
        self._queued_api = 0
        self._affinity: dict[TrajectoryId, str] | None = (
            None  # envs.affinity(), until it may change
        )
        self._envs_on: Counter[str] = Counter()  # per CPU node, with _affinity (_read_affinity)
        self._idle_due: float | None = None

    # ------------------------------------------------------------------ entry point
    def handle(self, event: ev.Event, now: float) -> list[ev.Command]:
        self.stimulus = next(self._stimuli)
        out: list[ev.Command] = []
        kind = type(event)
        if kind not in _KEEP_IDLE_BOUND:
            self._idle_due = None
            self._affinity = None  # environments may open, move or go
        elif isinstance(event, ev.SubmitExec) and (event.spec.env is None or event.spec.session):
            self._affinity = None  # a throwaway environment opens
        handler = _HANDLERS[kind]
        try:
            handler(self, event, now, out)
        except TangramError as exc:
            token = getattr(event, "token", None)
            if token is None:
                raise
            out.append(self._reply(token, error=(exc.code, exc.message)))
        if self._dirty and self._pass_due is None:
            self._pass_due = max(now, self._last_pass + self.cfg.coalesce_s)
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
        idle = self._idle_due
        if idle is None or idle <= now:
            idle = self._idle_due = min(self.envs.idle_deadlines(), default=math.inf)
        if idle != math.inf:
            times.append(idle)
        if self._queued_api:
            for pool in self.apis.values():
                t = pool.next_grant_time(now)
                if t is not None:
                    times.append(t)
        return min(times) if times else None

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):x}"

    def _reply(
        self, token: int, result: Any = None, error: tuple[str, str] | None = None
    ) -> ev.Reply:
        return ev.Reply(token=token, result=result, error=error, cause=self.stimulus)

    def _transition(self, rec: ActionRec, new: str, now: float, why: str) -> None:
        transition(rec, new, ACTION_EDGES, now, why, self.stimulus)

    # ------------------------------------------------------------------ actions
    def _submit_exec(self, e: ev.SubmitExec, now: float, out: list[ev.Command]) -> None:
        if self.shutting_down:
            raise ShuttingDown("daemon is shutting down")
        spec = e.spec
        cpus: Any = 1 if spec.cpus is None else spec.cpus
        t1_s, eff = spec.t1_s, spec.eff
        if spec.profile is not None:
            prof = self.profiles.get(spec.profile)
            if prof is None:
                raise NotFound(
                    f"profile {spec.profile!r} not found (see `tangramctl profile --save`)"
                )
            if prof.get("elastic", True):
                t1_s, eff = prof["t1_s"], prof["eff"]
                if spec.cpus is None:
                    dops = sorted(int(k) for k in prof["dop"])
                    cpus = [dops[0], dops[-1]]
        if isinstance(cpus, tuple):
            cpus = list(cpus)
        session = self._session_for(spec.session, spec.env, e.peer) if spec.session else None
        if session is not None:
            env = self._ready_env(session.env, e.peer)
        elif spec.env is not None:
            opened = self.envs.open_env(spec.env, e.peer)
            if opened is None:
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
            env = self.envs.open(
                now,
                out,
                self.stimulus,
                image=spec.image,
                mem=spec.mem,
                trajectory=spec.trajectory,
                throwaway=True,
                token=None,
                conn=e.conn,
                owner=e.peer,
            )
        max_cores = max((p.capacity for p in self.cpu.nodes), default=0)
        aid = ActionId(self._new_id("a"))
        try:
            action = make_action(
                aid,
                "exec",
                env.trajectory,
                {"cpu": cpus},
                task=spec.task or "default",
                seq=next(self._seq),
                t1_s=t1_s,
                eff=eff,
                submitted_at=now,
                klass=f"{spec.task or 'default'}/exec/{_command_class(spec.cmd)}",
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
            history=self.stories.open(aid),
            spec=spec,
            run_as=e.peer if self.cfg.exec_as_peer else None,
        )
        self.actions[aid] = rec
        if session is not None:
            session.busy = aid  # one command at a time per shell
        note(
            rec, now, "submitted", f"cpus={cpus} env={env.id} cmd={_short(spec.cmd)}", self.stimulus
        )
        env.active += 1
        env.last_used = now
        if env.state == "ready":
            self._enqueue(rec, now)
        elif env.state == "lost":
            self.envs.recreate(env, now, out, self.stimulus)
            env.pending.append(aid)
            self._transition(rec, "waiting_env", now, f"environment {env.id} being recreated")
        else:
            env.pending.append(aid)
            self._transition(rec, "waiting_env", now, f"environment {env.id} being created")

    def _enqueue(self, rec: ActionRec, now: float) -> None:
        self._transition(rec, "queued", now, "ready to schedule")
        self.queue[rec.action.id] = rec
        self._queued_api += rec.action.kind == "api"
        self._fresh[rec.action.id] = None
        self._dirty = True
        pool_id = self._cpu_pool_of(rec)
        if pool_id is not None:  # the "priced" rule's arrival forecast
            self.meter.submitted(pool_id, now, rec.action.elastic)

    def _unqueue(self, aid: ActionId) -> ActionRec | None:
        rec = self.queue.pop(aid, None)
        self._fresh.pop(aid, None)
        if rec is not None and rec.action.kind == "api":
            self._queued_api -= 1
        return rec

    def _cpu_pool_of(self, rec: ActionRec) -> str | None:
        """The CPU pool an exec action runs in (its environment's node), if placed."""
        if rec.action.kind != "exec" or rec.env is None:
            return None
        env = self.envs.get(rec.env)
        return f"cpu:{env.node}" if env is not None and env.node else None

    def _finish_action(
        self,
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
        if rec.state == "done":
            return
        env = self.envs.get(rec.env) if rec.env else None
        if env is not None and rec.action.id in env.pending:
            env.pending.remove(rec.action.id)
        self._unqueue(rec.action.id)
        if rec.spec is not None and rec.spec.session is not None:
            self._session_idle(rec.spec.session, rec.action.id)
        if rec.units:
            self.pools[rec.pool_id].release(rec.action.id)
            self.meter.finished(rec.pool_id, rec.action.id)
            self._dirty = True
        self._transition(rec, "done", now, f"{outcome} {detail}".strip())
        rec.outcome = outcome
        rec.finished_at = now
        queue_s = (rec.started_at or now) - rec.submitted_at
        if result is None:
            exec_s = now - rec.started_at if rec.started_at is not None else 0.0
            result = ExecResult(outcome, exec_s=exec_s, detail=detail)  # type: ignore[arg-type]
        self.finished.append((rec.action.kind, queue_s, result.exec_s))
        if env is not None:
            env.active = max(0, env.active - 1)
            env.last_used = now
            if not env.active and self._idle_due is not None:  # idle from now on, maybe
                self._idle_due = min(self._idle_due, now + self.envs.defaults.idle_ttl_s)
        if rec.token is not None:
            if error is not None:
                out.append(self._reply(rec.token, error=error))
            elif rec.call is not None:
                ended = call or CallResult(outcome, error=detail)  # type: ignore[arg-type]
                answer = self._call_answer(rec, now, queue_s, ended)
                out.append(self._reply(rec.token, result=answer.to_wire()))
            else:
                final = result.placed(
                    action_id=rec.action.id,
                    queue_s=queue_s,
                    cores=rec.units,
                    node=env.node if env else None,
                )
                out.append(self._reply(rec.token, result=final.to_wire()))
            rec.token = None
        if env is not None and env.active == 0 and env.throwaway:
            self._close_env(env, now, out, "throwaway environment done")
        # forget the record (the story keeps what happened), bounded memory for long runs
        self.actions.pop(rec.action.id, None)
        self.recent[rec.action.id] = outcome
        if len(self.recent) > STORY_LIMIT:
            self.recent.popitem(last=False)

    def _close_env(self, env: EnvRec, now: float, out: list[ev.Command], why: str) -> None:
        for aid in self.envs.close(env, now, out, why, self.stimulus):
            self._finish_action(self.actions[aid], now, out, outcome="rejected", detail=why)

    # ------------------------------------------------------------------ scheduling
    def _read_affinity(self) -> dict[TrajectoryId, str]:
        """The environments' affinity, read afresh, and the count per CPU node derived
        from it (the priced rule's bound, ``PoolLoad.envs``): both cached together."""
        affinity = self._affinity = self.envs.affinity()
        self._envs_on = Counter(affinity.values())
        return affinity

    def run_pass(self, now: float, out: list[ev.Command]) -> None:
        self._pass_due = None
        self._dirty = False
        if not self.queue:
            self._fresh.clear()
            return  # nothing scheduled: the next arrival still finds the daemon quiet
        self._last_pass = now
        for pool in self.apis.values():
            pool.advance(now)
        short = None
        affinity = self._affinity
        cached = affinity is not None
        if affinity is None:
            affinity = self._read_affinity()
        envs_on = self._envs_on
        load = {
            p.pool_id: self.meter.load(p.pool_id, now, envs_on.get(p.pool_id, 0))
            for p in self.cpu.nodes
        }
        if self.cfg.short_passes:
            short = self._short_waiting(affinity)
        if short is not None:
            decision = self._nothing_fits(short, affinity) or schedule(
                Snapshot(
                    waiting=short,
                    pools=self.pools,
                    affinity=affinity,
                    estimate=self.history.estimate,
                    load=load,
                ),
                now,
                self.cfg.sched,
            )
            if decision.infeasible and any(n.free_units() for n in self.cpu.nodes):
                short = None  # the prefix may shift past an infeasible action: read it all
            else:
                self.passes_short += 1
        if short is None:
            if cached:  # never a cached one here (one read in this pass is fresh)
                affinity = self._read_affinity()
            running: dict[str, list[tuple[float, int]]] = {}
            for rec in self.actions.values():
                if rec.state == "running" and rec.pool_id:
                    started = rec.started_at if rec.started_at is not None else now
                    exp = started + rec.expected_s
                    if exp <= now:  # overdue: expect it to run about as long again as it has
                        exp = now + (now - started)
                    running.setdefault(rec.pool_id, []).append((exp, len(rec.units) or 1))
            snap = Snapshot(
                waiting=[rec.action for rec in self.queue.values()],
                pools=self.pools,
                affinity=affinity,
                running=running,
                estimate=self.history.estimate,
                load=load,
            )
            decision = schedule(snap, now, self.cfg.sched)
            self._seen_plain = all(
                rec.action.kind == "exec" and rec.action.trajectory in affinity
                for rec in self.queue.values()
            )
        self._fresh.clear()
        self._seen_affinity = affinity
        self._seen_pools = self._pool_identity()
        self.passes += 1
        for inf in decision.infeasible:
            rec = self.actions[inf.action_id]
            self._finish_action(
                rec,
                now,
                out,
                outcome="rejected",
                detail=f"infeasible: {inf.shortfall.describe()}",
                error=("unschedulable", inf.shortfall.describe()),
            )
        for p in decision.placements:
            placed = self._unqueue(p.action_id)
            assert placed is not None, "the scheduler places queued actions only"
            rec = placed
            pool = self.pools[p.pool_id]
            pool.allocate(p.action_id, p.units)
            rec.pool_id = p.pool_id
            rec.units = p.units
            rec.started_at = now
            rec.expected_s = p.expected_s
            env = self.envs.get(rec.env) if rec.env else None
            if rec.action.kind == "exec":
                elastic = rec.action.elastic
                throwaway = env is not None and env.throwaway
                self.meter.started(
                    p.pool_id, p.action_id, now, elastic, p.amount, p.expected_s, throwaway
                )
            node = env.node if env else None
            note(rec, now, "placed", Placed(p.pool_id, p.units, node, p.expected_s), self.stimulus)
            if rec.action.kind == "exec":
                self._transition(rec, "running", now, "exec sent to the backend")
                self._start_exec(rec, out, env)
            elif rec.action.kind == "service":
                self._start_call(rec, now, out)
            else:
                self._transition(rec, "running", now, "lease granted")
                self._grant_lease(rec, now, out)

    def _nothing_fits(
        self, short: list[Action], affinity: dict[TrajectoryId, str]
    ) -> Decision | None:
        """What ``schedule`` decides on a short pass's actions when none of their pools has
        a free unit (an arrival under a flood): nothing is placed, and those that can never
        fit their pool are infeasible, found as ``schedule`` finds them; None when one has a
        free unit or an action is not an exec on a known CPU pool (``schedule`` decides)."""
        infeasible: list[Infeasible] = []
        for action in short:
            pid = affinity.get(action.trajectory)
            if action.kind != "exec" or pid is None:
                return None
            pool = self.pools.get(pid)
            if not isinstance(pool, CpuNodePool) or pool.free_units():
                return None
            shortfall = pool.never_fits(action)  # (two comparisons: not worth a memo here)
            if shortfall is not None:
                infeasible.append(Infeasible(action.id, shortfall))
        self.passes_full_pools += 1
        bad = {i.action_id for i in infeasible}
        waiting = tuple(a.id for a in short if a.id not in bad)
        return Decision((), waiting, tuple(infeasible), 0.0, 0)

    def _pool_identity(self) -> tuple[tuple[str, int], ...]:
        return tuple((pid, id(pool)) for pid, pool in self.pools.items())

    def _short_waiting(self, affinity: dict[TrajectoryId, str]) -> list[Action] | None:
        """The part of the queue a pass must read when the rest provably cannot change its
        decision; None: read the whole queue.

        Under a flood of short execs most passes follow one completion (a core or two
        free, hundreds queued) or one arrival (no core free): the full pass reads every
        queued action to start at most one. The pass may read only a prefix when

        - every queued action is an exec whose trajectory has a node (checked by the last
          full pass, and here for the actions queued since), and the trajectories' nodes
          and the pools are those the previous pass saw: every action that pass read was
          checked against its pool then (``never_fits`` depends on the pool alone) and
          nothing has moved since;
        - on each pool with ``f`` free units, its first ``f`` queued actions (FCFS) are
          non-elastic 1-unit actions: the scheduler takes exactly those and stops there (a
          full pool places nothing), so nothing behind them is read for the placement.

        The prefix is those actions plus the actions queued since the previous pass (to be
        checked once); the scheduler then decides on it as on the whole queue. If an action
        turns out infeasible while a pool has free units, the caller reads the whole queue
        (the prefix would have to reach past it).
        """
        if not self._seen_plain or (
            affinity is not self._seen_affinity and affinity != self._seen_affinity
        ):
            return None
        if self._pool_identity() != self._seen_pools:
            return None
        to_fill: dict[str, int] = {}
        for node in self.cpu.nodes:
            free = node.free_units()
            if free:
                to_fill[node.pool_id] = free
        picked: list[Action] = []
        fresh = self._fresh
        seen: set[ActionId] = set()  # fresh actions inside the prefix
        for aid, rec in self.queue.items():
            if not to_fill:
                break
            action = rec.action
            if action.kind != "exec":
                return None
            pid = affinity.get(action.trajectory)
            if pid is None:
                return None
            left = to_fill.get(pid)
            if left:
                if action.elastic or action.min_units != 1:
                    return None
                picked.append(action)
                if left == 1:
                    del to_fill[pid]
                else:
                    to_fill[pid] = left - 1
            elif aid in fresh:
                picked.append(action)
            if aid in fresh:
                seen.add(aid)
        # The other fresh actions lie past the prefix (both keep the order of queueing).
        for aid in fresh:
            late = self.queue.get(aid)
            if late is None or aid in seen:
                continue
            action = late.action
            if action.kind != "exec" or action.trajectory not in affinity:
                return None
            picked.append(action)
        return picked

    def _start_exec(self, rec: ActionRec, out: list[ev.Command], env: EnvRec | None) -> None:
        assert env is not None and rec.spec is not None, "exec actions have an env and a spec"
        out.append(
            ev.RunExec(
                action_id=rec.action.id,
                env_id=env.id,
                node=env.node,
                cores=tuple(rec.units),
                spec=rec.spec,
                max_output=self.cfg.max_output,
                run_as=rec.run_as,
                cause=self.stimulus,
            )
        )

    def _exec_done(self, e: ev.ExecFinished, now: float, out: list[ev.Command]) -> None:
        rec = self.actions.get(ActionId(e.action_id))
        if rec is None or rec.state != "running":
            return
        res = e.result
        env = self.envs.get(rec.env) if rec.env else None
        if res.outcome == "infra_error" and env is not None and e.env_lost:
            self.envs.lose(env, now, res.detail or "backend lost it")
        elif res.outcome in ("ok", "failed"):
            self.history.observe(rec.action.klass, res.exec_s)
        self._finish_action(
            rec,
            now,
            out,
            outcome=res.outcome,
            result=res,
            detail=f"exit={res.exit_code} exec_s={res.exec_s:.4f} {res.detail}".strip(),
        )

    # ------------------------------------------------------------------ environments
    def _open(self, e: ev.OpenEnv, now: float, out: list[ev.Command]) -> None:
        if self.shutting_down:
            raise ShuttingDown("daemon is shutting down")
        self.envs.open(
            now,
            out,
            self.stimulus,
            image=e.image,
            mem=e.mem,
            trajectory=e.trajectory,
            throwaway=False,
            token=e.token,
            conn=e.conn,
            owner=e.peer,
        )

    def _close(self, e: ev.CloseEnv, now: float, out: list[ev.Command]) -> None:
        env = self.envs.open_env(e.env_id, e.peer)
        if env is None:
            raise NotFound(f"environment {e.env_id!r} not found")
        env.close_token = e.token
        self._close_env(env, now, out, "closed by client")

    def _env_created(self, e: ev.EnvCreated, now: float, out: list[ev.Command]) -> None:
        answer = self.envs.created(e.env_id, e.error, now)
        if answer is None:
            return
        env = answer.env
        token, env.open_token = env.open_token, None
        if isinstance(answer, Ready):
            if not env.throwaway and self.cfg.record_envs:
                record = self.envs.record(env)
                out.append(ev.RecordEnv(env_id=env.id, record=record, cause=self.stimulus))
            if token is not None:
                out.append(self._reply(token, result={"id": env.id, "node": env.node}))
            for aid in answer.pending:
                self._enqueue(self.actions[aid], now)
            return
        assert isinstance(answer, Failed)
        if token is not None:
            out.append(self._reply(token, error=("infra_error", answer.error)))
        for aid in answer.pending:
            self._finish_action(
                self.actions[aid],
                now,
                out,
                outcome="infra_error",
                detail=f"environment creation failed: {answer.error}",
            )
        self._close_env(env, now, out, f"creation failed: {answer.error}")

    def _env_removed(self, e: ev.EnvRemoved, now: float, out: list[ev.Command]) -> None:
        gone = self.envs.removed(e.env_id, now, out, self.stimulus)
        if gone is None:
            return
        self._forget_sessions(gone.env.id, now, out)
        if not gone.env.throwaway and not self.shutting_down and self.cfg.record_envs:
            out.append(ev.RecordEnv(env_id=gone.env.id, record=None, cause=self.stimulus))
        if gone.env.close_token is not None:
            out.insert(0, self._reply(gone.env.close_token, result={"closed": True}))

    def _envs_recovered(self, e: ev.EnvsRecovered, now: float, out: list[ev.Command]) -> None:
        adopted = self.envs.adopt(e.envs, now)
        if len(adopted) != len(e.envs):
            self._persist_envs(out)  # forget the records that could not be adopted

    def _persist_envs(self, out: list[ev.Command]) -> None:
        if self.cfg.record_envs:
            out.append(ev.PersistEnvs(envs=self.envs.records(), cause=self.stimulus))

    # ------------------------------------------------------------------ environment I/O
    def _ready_env(self, env_id: str, peer: tuple[int, int] | None = None) -> EnvRec:
        env = self.envs.open_env(env_id, peer)
        if env is None:
            raise NotFound(f"environment {env_id!r} not found")
        if env.state != "ready":
            raise InfraError(f"environment {env_id} is {env.state}, not ready")
        return env

    def _put_file(self, e: ev.PutFile, now: float, out: list[ev.Command]) -> None:
        self._transfer(e, "put", e.data, e.tar, now, out)

    def _get_file(self, e: ev.GetFile, now: float, out: list[ev.Command]) -> None:
        self._transfer(e, "get", b"", False, now, out)

    def _transfer(
        self,
        e: ev.PutFile | ev.GetFile,
        direction: str,
        data: bytes,
        tar: bool,
        now: float,
        out: list[ev.Command],
    ) -> None:
        env = self._ready_env(e.env_id, e.peer)
        env.last_used = now
        out.append(
            ev.RunTransfer(
                token=e.token,
                env_id=env.id,
                node=env.node,
                direction=direction,
                path=e.path,
                data=data,
                tar=tar,
                max_bytes=self.cfg.max_transfer,
                cause=self.stimulus,
            )
        )

    def _transfer_done(self, e: ev.TransferDone, now: float, out: list[ev.Command]) -> None:
        env = self.envs.get(e.env_id)
        if env is not None:
            env.last_used = now
        if e.token is not None:
            out.append(self._reply(e.token, result=e.result, error=e.error))

    # ------------------------------------------------------------------ shell sessions
    def _session_of(self, session_id: str, peer: tuple[int, int] | None) -> SessionRec:
        """An open session whose environment ``peer`` may use (else, as if none)."""
        session = self.sessions.get(session_id)
        if (
            session is None
            or session.state != "open"
            or self.envs.open_env(session.env, peer) is None
        ):
            raise NotFound(f"session {session_id!r} not found (or not open)")
        return session

    def _session_for(
        self, session_id: str, env_id: str | None, peer: tuple[int, int] | None
    ) -> SessionRec:
        session = self._session_of(session_id, peer)
        if env_id is not None and env_id != session.env:
            raise BadRequest(f"session {session_id} belongs to environment {session.env}")
        if session.busy is not None:
            raise BadRequest(f"session {session_id} is busy with {session.busy}")
        return session

    def _session_idle(self, session_id: str, action_id: ActionId) -> None:
        session = self.sessions.get(session_id)
        if session is not None and session.busy == action_id:
            session.busy = None

    def _open_session(self, e: ev.OpenSession, now: float, out: list[ev.Command]) -> None:
        if self.shutting_down:
            raise ShuttingDown("daemon is shutting down")
        env = self._ready_env(e.env_id, e.peer)
        env.last_used = now
        sid = self._new_id("s")
        session = SessionRec(id=sid, env=env.id, node=env.node, open_token=e.token)
        session.history.append((now, "new", "opening", "session.open"))
        self.sessions[sid] = session
        run_as = e.peer if self.cfg.exec_as_peer else None
        out.append(
            ev.StartShell(
                session_id=sid, env_id=env.id, node=env.node, run_as=run_as, cause=self.stimulus
            )
        )

    def _session_opened(self, e: ev.SessionOpened, now: float, out: list[ev.Command]) -> None:
        session = self.sessions.get(e.session_id)
        if session is None:
            return
        token, session.open_token = session.open_token, None
        if e.error is not None:
            if session.state == "opening":
                transition(session, "closed", SESSION_EDGES, now, e.error)
            del self.sessions[session.id]
            if token is not None:
                out.append(self._reply(token, error=("infra_error", e.error)))
            return
        if session.state != "opening":  # closed while starting: end the shell (again)
            out.append(ev.EndShell(session_id=session.id, node=session.node, cause=self.stimulus))
            if token is not None:
                out.append(self._reply(token, error=("not_found", "session closed meanwhile")))
            return
        transition(session, "open", SESSION_EDGES, now, "shell started")
        if token is not None:
            out.append(self._reply(token, result={"id": session.id, "env": session.env}))

    def _interrupt_session(self, e: ev.InterruptSession, now: float, out: list[ev.Command]) -> None:
        session = self._session_of(e.session_id, e.peer)
        busy = session.busy is not None
        if busy:
            out.append(
                ev.InterruptShell(session_id=session.id, node=session.node, cause=self.stimulus)
            )
        if e.token is not None:
            out.append(self._reply(e.token, result={"interrupted": busy}))

    def _close_session(self, e: ev.CloseSession, now: float, out: list[ev.Command]) -> None:
        session = self.sessions.get(e.session_id)
        if (
            session is None
            or session.state in ("closing", "closed")
            or self.envs.open_env(session.env, e.peer) is None
        ):
            raise NotFound(f"session {e.session_id!r} not found")
        transition(session, "closing", SESSION_EDGES, now, "session.close")
        session.close_token = e.token
        out.append(ev.EndShell(session_id=session.id, node=session.node, cause=self.stimulus))

    def _session_closed(self, e: ev.SessionClosed, now: float, out: list[ev.Command]) -> None:
        session = self.sessions.pop(e.session_id, None)
        if session is None:
            return
        if session.state == "closing":
            transition(session, "closed", SESSION_EDGES, now, "shell ended")
        if session.close_token is not None:
            out.append(self._reply(session.close_token, result={"closed": True}))

    def _forget_sessions(self, env_id: str, now: float, out: list[ev.Command]) -> None:
        """The environment was removed: its shells went with it."""
        for session in [s for s in self.sessions.values() if s.env == env_id]:
            del self.sessions[session.id]
            transition(session, "closed", SESSION_EDGES, now, "environment removed")
            for token in (session.open_token, session.close_token):
                if token is not None:
                    out.append(self._reply(token, error=("not_found", "environment removed")))

    def session_rows(self) -> list[dict[str, Any]]:
        return [
            {"id": s.id, "env": s.env, "state": s.state, "busy": s.busy}
            for s in self.sessions.values()
        ]

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
        rec = ActionRec(
            action=action,
            token=e.token,
            env=None,
            conn=e.conn,
            submitted_at=now,
            history=self.stories.open(aid),
        )
        self.actions[aid] = rec
        self.leases[aid] = LeaseRec(aid, e.api, ttl, policy, deadline, conn=e.conn)
        note(rec, now, "submitted", f"lease api={e.api} ttl={ttl} policy={policy}", self.stimulus)
        self._enqueue(rec, now)

    def _grant_lease(self, rec: ActionRec, now: float, out: list[ev.Command]) -> None:
        lease = self.leases[rec.action.id]
        transition(lease, "granted", LEASE_EDGES, now, "capacity granted")
        lease.expires_at = now + lease.ttl_s
        if rec.token is not None:
            result = {
                "lease_id": rec.action.id,
                "api": lease.api,
                "ttl_s": lease.ttl_s,
                "queue_s": now - rec.submitted_at,
            }
            out.append(self._reply(rec.token, result=result))
            rec.token = None

    def _end_lease(self, lease: LeaseRec, now: float, out: list[ev.Command], state: str) -> None:
        rec = self.actions[lease.action_id]
        transition(lease, state, LEASE_EDGES, now, state)
        if rec.started_at is not None:
            self.history.observe(rec.action.klass, now - rec.started_at)
        self._finish_action(
            rec, now, out, outcome="ok" if state == "released" else state, detail=f"lease {state}"
        )

    def _release(self, e: ev.ReleaseLease, now: float, out: list[ev.Command]) -> None:
        lease = self.leases.get(ActionId(e.lease_id))
        if lease is None:
            raise NotFound(f"lease {e.lease_id!r} not found")
        released = lease.state == "granted"
        if released:
            self._end_lease(lease, now, out, "released")
        if e.token is not None:
            out.append(self._reply(e.token, result={"released": released}))

    # ------------------------------------------------------------------ GPU services
    def _register_service(self, e: ev.RegisterService, now: float, out: list[ev.Command]) -> None:
        """Validate the spec; the host loads it (``LoadService``) and only once it has
        (``ServiceLoaded``) does the pool learn the service and the client get its answer."""
        if self.shutting_down:
            raise ShuttingDown("daemon is shutting down")
        if self.gpu is None:
            raise BadRequest(
                "this daemon has no GPUs: declare [gpu] simulated = { count = N, mem_gb = G } "
                "or run it on a host with NVML GPUs"
            )
        try:
            spec = ServiceSpec.from_json(e.args)
        except SpecError as exc:
            raise BadRequest(str(exc)) from None
        name = spec.name
        if name in self._registering or name in self._removing:
            what = "registered" if name in self._registering else "removed"
            raise BadRequest(f"service {name!r} is being {what}; try again when that is done")
        known = self.services.get(name)
        if known is not None and known != spec:
            raise BadRequest(f"service {name!r} is already registered differently; remove it first")
        pool_spec = spec.pool_spec()
        if not any(node.fits_memory(pool_spec, k) for node in self.gpu.nodes for k in spec.gpus):
            largest = max(node.mem_per_gpu for node in self.gpu.nodes)
            raise BadRequest(
                f"service {name!r}: mem_gb={spec.mem_gb:g} does not fit on "
                f"{'/'.join(map(str, spec.gpus))} GPU(s) of {largest} bytes each "
                f"(a node has {self.gpu.max_single()} GPUs)"
            )
        self._registering[name] = e.token
        out.append(ev.LoadService(spec=spec, cause=self.stimulus))

    def _service_loaded(self, e: ev.ServiceLoaded, now: float, out: list[ev.Command]) -> None:
        token = self._registering.pop(e.spec.name, None)
        if e.error is None:
            self._add_service(e.spec)
            if token is not None:
                out.append(self._reply(token, result=dict(e.info)))
        elif token is not None:
            out.append(self._reply(token, error=(e.code, e.error)))

    def _services_recovered(
        self, e: ev.ServicesRecovered, now: float, out: list[ev.Command]
    ) -> None:
        for spec in e.specs:
            self._add_service(spec)

    def _add_service(self, spec: ServiceSpec) -> None:
        assert self.gpu is not None, "services need the gpu pool"
        self.gpu.register_service(spec.pool_spec())
        self.services[spec.name] = spec

    def _remove_service(self, e: ev.RemoveService, now: float, out: list[ev.Command]) -> None:
        """Queued calls end ``rejected`` at once; running ones end when the host stops the
        service's replicas (``UnloadService``), which also answers the client."""
        if e.name not in self.services:
            raise NotFound(f"service {e.name!r} is not registered")
        del self.services[e.name]
        rejected = 0
        for rec in list(self.queue.values()):
            if rec.call is not None and rec.call.name == e.name:
                why = f"service {e.name!r} was removed"
                self._finish_action(rec, now, out, outcome="rejected", detail=why)
                rejected += 1
        assert self.gpu is not None, "a registered service implies the gpu pool"
        self.gpu.unregister_service(e.name)
        self._removing[e.name] = (e.token, rejected)
        out.append(ev.UnloadService(name=e.name, cause=self.stimulus))

    def _service_unloaded(self, e: ev.ServiceUnloaded, now: float, out: list[ev.Command]) -> None:
        token, rejected = self._removing.pop(e.name, (None, 0))
        if token is not None:
            answer = {"name": e.name, "removed": True, "rejected": rejected}
            out.append(self._reply(token, result=answer))

    def _submit_call(self, e: ev.SubmitCall, now: float, out: list[ev.Command]) -> None:
        if self.shutting_down:
            raise ShuttingDown("daemon is shutting down")
        name = e.spec.name
        spec = self.services.get(name)
        if spec is None or self.gpu is None:
            raise NotFound(f"service {name!r} is not registered (see `tangramctl service list`)")
        # The GPU counts whose shard fits a GPU; with no elasticity known for a call, the
        # scheduler runs it at the smallest of them (its minimum).
        largest, pool_spec = self.gpu.max_single(), spec.pool_spec()
        counts = [
            k
            for k in spec.gpus
            if k <= largest and any(node.fits_memory(pool_spec, k) for node in self.gpu.nodes)
        ] or [min(spec.gpus)]
        demand: Any = counts[0] if len(counts) == 1 else {"set": counts}
        aid = ActionId(self._new_id("c"))
        action = make_action(
            aid,
            "service",
            f"call-{aid}",
            {"gpu": demand},
            service=name,
            seq=next(self._seq),
            submitted_at=now,
            klass=f"service/{name}",
            capacity={"gpu": largest},
        )
        timeout = e.spec.timeout_s if e.spec.timeout_s is not None else self.cfg.call_timeout_s
        rec = ActionRec(
            action=action,
            token=e.token,
            env=None,
            conn=e.conn,
            submitted_at=now,
            history=self.stories.open(aid),
            call=replace(e.spec, timeout_s=timeout),
        )
        self.actions[aid] = rec
        detail = f"call service={name} gpus={counts} timeout_s={timeout:g}"
        note(rec, now, "submitted", detail, self.stimulus)
        self._enqueue(rec, now)

    def _start_call(self, rec: ActionRec, now: float, out: list[ev.Command]) -> None:
        """Placed on GPUs: ask the pool for the restore plan (LRU evictions on those GPUs,
        then the restore) and send it with the call to the node's service host."""
        assert self.gpu is not None and rec.call is not None, "calls hold GPUs and a spec"
        self._gpu_tick += 1
        plan = self.gpu.restore_for(rec.action.id, rec.call.name, self._gpu_tick)
        node, local = self._gpu_place(rec.units)
        evicted = tuple(v._replace(gpu=self.gpu.locate(v.gpu)[1]) for v in plan.evicted)
        if plan.needed:
            victims = sorted({f"{v.service}@{v.dop}" for v in evicted})
            why = f"restore onto node={node} gpus={list(local)} est_s={plan.seconds:.3g}"
            why += f" evicting {victims}" if victims else ""
        else:
            why = f"resident on node={node} gpus={list(local)}"
        self._transition(rec, "running", now, why)
        out.append(
            ev.RunCall(
                action_id=rec.action.id,
                service=rec.call.name,
                node=node,
                gpus=local,
                evicted=evicted,
                payload=rec.call.payload,
                timeout_s=rec.call.timeout_s or self.cfg.call_timeout_s,
                cause=self.stimulus,
            )
        )

    def _call_done(self, e: ev.CallFinished, now: float, out: list[ev.Command]) -> None:
        rec = self.actions.get(ActionId(e.action_id))
        if rec is None or rec.state != "running":
            return
        if e.outcome in ("ok", "failed"):
            self.history.observe(rec.action.klass, e.exec_s)
        if e.h2d_bytes_per_s and self.gpu is not None:
            node = self.gpu.node_of_action(rec.action.id)
            if node is not None:
                self.gpu.node(node).observe_h2d(e.h2d_bytes_per_s)
        call = CallResult(
            e.outcome,  # type: ignore[arg-type]  # the host's outcomes are OUTCOMES
            result=e.result,
            error=e.error,
            restore_s=e.restore_s,
            exec_s=e.exec_s,
        )
        detail = f"restore_s={e.restore_s:.4f} exec_s={e.exec_s:.4f} {e.error or ''}".strip()
        self._finish_action(
            rec,
            now,
            out,
            outcome=e.outcome,
            result=ExecResult(call.outcome, exec_s=e.restore_s + e.exec_s, detail=detail),
            detail=detail,
            call=call,
        )

    def _call_answer(
        self, rec: ActionRec, now: float, queue_s: float, call: CallResult
    ) -> CallResult:
        node, local = self._gpu_place(rec.units) if rec.units else (None, ())
        return replace(
            call,
            queue_s=queue_s,
            act_s=now - rec.submitted_at,
            gpus=local,
            node=node,
            action_id=rec.action.id,
        )

    def _gpu_place(self, units: Sequence[int]) -> tuple[str, tuple[int, ...]]:
        """``(node, local GPU ids)`` of global GPU ids on one node."""
        assert self.gpu is not None
        located = [self.gpu.locate(unit) for unit in units]
        return located[0][0], tuple(local for _, local in located)

    # ------------------------------------------------------------------ profiles
    def _save_profile(self, e: ev.SaveProfile, now: float, out: list[ev.Command]) -> None:
        prof = {k: e.profile.get(k) for k in ("dop", "t1_s", "eff", "speedup", "elastic")}
        if not prof["dop"] or prof["t1_s"] is None or not prof["eff"]:
            raise InvalidDemand("profile", "needs dop, t1_s and eff")
        prof["elastic"] = bool(prof["elastic"] if prof["elastic"] is not None else True)
        self.profiles[e.name] = prof
        out.append(ev.PersistProfiles(profiles=dict(self.profiles), cause=self.stimulus))
        if e.token is not None:
            out.append(self._reply(e.token, result={"name": e.name, "saved": True}))

    def _profiles_loaded(self, e: ev.ProfilesLoaded, now: float, out: list[ev.Command]) -> None:
        for name, prof in e.profiles.items():
            self.profiles.setdefault(name, dict(prof))

    # ------------------------------------------------------------------ nodes (cluster mode)
    def _node_joined(self, e: ev.NodeJoined, now: float, out: list[ev.Command]) -> None:
        pool_id = f"cpu:{e.node}"
        if pool_id in self.pools or not e.cores_by_numa:
            return  # a known node came back within the timeout, or a pure gateway
        pool = CpuNodePool(e.node, e.cores_by_numa, e.mem_bytes)
        self.cpu.add_node(pool)
        self.pools[pool_id] = pool
        self.envs.reclaim(e.node, now)
        self._dirty = True

    def _node_lost(self, e: ev.NodeLost, now: float, out: list[ev.Command]) -> None:
        """End the node's running actions (``infra_error``), lose its environments, drop
        its pool, and move the queued work of its throwaway environments elsewhere.

        Running actions never hang: they end here, naming the node. Persistent
        environments stay in the book as lost, so the next action on one gets
        ``env_lost``. A throwaway environment holds no state worth keeping: its actions
        that had not started wait for a fresh one on another node.
        """
        why = f"node {e.node} lost: {e.why}"
        self.envs.give_up(e.node)
        on_node = [env for env in self.envs if env.node == e.node]
        ids = {env.id for env in on_node}
        moving: list[EnvRec] = []
        for rec in list(self.actions.values()):
            env = self.envs.get(rec.env) if rec.env in ids else None
            if env is None:
                continue
            if rec.state == "running" or not env.throwaway:
                self._finish_action(rec, now, out, outcome="infra_error", detail=why)
            elif rec.state == "queued":
                self._unqueue(rec.action.id)
                env.pending.append(rec.action.id)
                self._transition(rec, "waiting_env", now, f"{why}; moving to another node")
        for env in on_node:
            if env.state in ("closing", "closed"):
                self.envs.removed(env.id, now, out, self.stimulus)  # it will never answer
            elif env.throwaway and env.pending:
                moving.append(env)
            elif env.state == "creating":
                token, env.open_token = env.open_token, None
                if token is not None:
                    out.append(self._reply(token, error=("infra_error", why)))
                self._close_env(env, now, out, why)
            else:
                self.envs.lose_node(env, now, why)
        pool_id = f"cpu:{e.node}"
        if pool_id in self.pools:
            del self.pools[pool_id]
            self.cpu.remove_node(e.node)
        for env in moving:
            try:
                self.envs.move(env, now, out, self.stimulus, why)
            except TangramError as exc:  # no node could ever hold it now
                for aid in tuple(env.pending):
                    self._finish_action(
                        self.actions[aid], now, out, outcome="infra_error", detail=exc.message
                    )
        self._dirty = True

    def _envs_restored(self, e: ev.EnvsRestored, now: float, out: list[ev.Command]) -> None:
        for row in e.envs:
            self.envs.restore(
                now,
                env_id=str(row["id"]),
                trajectory=str(row["trajectory"]),
                node=str(row["node"]),
                image=row.get("image"),
                mem=int(row["mem"]),
                lost_node=str(row.get("lost_node") or ""),
            )

    def _drain_node(self, e: ev.DrainNode, now: float, out: list[ev.Command]) -> None:
        try:
            self.cpu.set_draining(e.node, e.drain)
        except KeyError:
            raise NotFound(f"node {e.node!r} not found (or lost)") from None
        if e.token is not None:
            out.append(self._reply(e.token, result={"name": e.node, "draining": e.drain}))

    # ------------------------------------------------------------------ ticks
    def _tick(self, now: float, out: list[ev.Command]) -> None:
        for lease in list(self.leases.values()):
            if lease.state == "granted" and lease.expires_at <= now:
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
                    detail="lease deadline passed",
                    error=("timeout", f"no {lease.api} capacity within the deadline"),
                )
        for lease_id in [
            k for k, v in self.leases.items() if v.state in ("released", "expired", "failed")
        ]:
            del self.leases[lease_id]
        if self._idle_due is None or self._idle_due <= now:  # (else none is due yet)
            for env in self.envs.idle_expired(now):
                self._close_env(env, now, out, "idle TTL expired")
        if (self._pass_due is not None and now >= self._pass_due) or self._dirty:
            self.run_pass(now, out)

    def _conn_closed(self, e: ev.ConnClosed, now: float, out: list[ev.Command]) -> None:
        # Waiting work of a dead client is dropped; its leases return at once (never leaked).
        for rec in list(self.actions.values()):
            if rec.conn != e.conn or rec.state == "done":
                continue
            rec.token = None
            if rec.action.kind == "api":
                lease = self.leases.get(rec.action.id)
                if lease is not None and lease.state == "granted":
                    self._end_lease(lease, now, out, "released")
                elif rec.state == "queued":
                    if lease is not None:
                        transition(lease, "failed", LEASE_EDGES, now, "client disconnected")
                    self._finish_action(rec, now, out, outcome="rejected", detail="client gone")
            elif rec.state in ("queued", "waiting_env"):
                self._finish_action(rec, now, out, outcome="rejected", detail="client gone")
        for env in self.envs:
            if env.throwaway and env.conn == e.conn and env.active == 0:
                self._close_env(env, now, out, "client gone")

    def _shutdown(self, e: ev.Shutdown, now: float, out: list[ev.Command]) -> None:
        """Refuse new work, end waiting work, return leases, close throwaway environments.

        Persistent environments belong to their trajectories, not to this process: they are
        kept, their records written, and the next daemon on this state dir re-adopts them.
        A throwaway environment with a running action closes when the action ends
        (``_finish_action``); the executor ends running execs through the backend.
        """
        self.shutting_down = True
        for rec in list(self.queue.values()) + [
            r for r in self.actions.values() if r.state == "waiting_env"
        ]:
            self._finish_action(rec, now, out, outcome="rejected", detail="daemon shutting down")
        for lease in list(self.leases.values()):
            if lease.state == "granted":
                self._end_lease(lease, now, out, "released")
        for env in self.envs:
            if env.throwaway and env.active == 0:
                self._close_env(env, now, out, "daemon shutting down")
            elif not env.throwaway and env.state in ("creating", "waiting_mem"):
                self._close_env(env, now, out, "daemon shutting down before it was ready")
        self._persist_envs(out)

    # ------------------------------------------------------------------ read model
    def trajectory_of(self, action_id: str) -> str | None:
        rec = self.actions.get(ActionId(action_id))
        return rec.action.trajectory if rec else None

    def status(self, now: float) -> dict[str, Any]:
        running = sum(1 for r in self.actions.values() if r.state == "running")
        return {
            "queued": len(self.queue),
            "running": running,
            "environments": self.envs.live_count(),
            "leases": sum(1 for lease in self.leases.values() if lease.state == "granted"),
            "passes": self.passes,
            "recent": _recent_summary(self.finished),
            "pools": {
                pid: {"capacity": p.capacity, "free": p.free_units()}
                for pid, p in self.pools.items()
            },
        }

    def queue_view(self, now: float) -> dict[str, list[dict[str, Any]]]:
        def row(rec: ActionRec) -> dict[str, Any]:
            a = rec.action
            return {
                "action_id": a.id,
                "kind": a.kind,
                "state": rec.state,
                "trajectory": a.trajectory,
                "pool": rec.pool_id or None,
                "waiting_s": (rec.started_at or now) - rec.submitted_at,
                "min": a.min_units,
                "max": a.key_amounts.max,
                "units": list(rec.units),
                "elastic": a.is_elastic(),
            }

        waiting = [row(r) for r in self.queue.values()]
        waiting += [row(r) for r in self.actions.values() if r.state == "waiting_env"]
        running = [row(r) for r in self.actions.values() if r.state == "running"]
        return {"waiting": waiting, "running": running}

    def story(self, action_id: str, origin: float) -> dict[str, Any]:
        """Every transition of one action, times relative to ``origin``."""
        log = self.stories.get(action_id)
        if log is None:
            raise NotFound(f"no story for action {action_id!r} (unknown or too old)")
        rec = self.actions.get(ActionId(action_id))
        outcome = self.recent.get(ActionId(action_id))
        return {
            "action_id": action_id,
            "state": rec.state if rec else ("done" if outcome else "forgotten"),
            "outcome": rec.outcome if rec else outcome,
            "events": [
                {
                    "t": t - origin,
                    "event": "finished" if new == "done" else new,
                    "from": old,
                    "detail": str(why),  # a placement's is formatted now (entities.Placed)
                    "cause": cause,
                }
                for t, old, new, why, cause in log
            ],
        }

    def env_rows(self, now: float) -> list[dict[str, Any]]:
        return self.envs.rows(now)

    def api_rows(self) -> list[dict[str, Any]]:
        waiting: dict[str, int] = {}
        for rec in self.queue.values():
            if rec.action.kind == "api":
                waiting[rec.action.api or ""] = waiting.get(rec.action.api or "", 0) + 1
        return [
            {
                "name": name,
                "concurrency": pool.concurrency,
                "quota": pool.quota,
                "period_s": pool.period_s,
                "overflow": pool.overflow,
                "in_use": pool.in_use,
                "free": pool.free_units(),
                "waiting": waiting.get(name, 0),
            }
            for name, pool in sorted(self.apis.items())
        ]

    def node_rows(self) -> list[dict[str, Any]]:
        """The ``nodes`` view of the nodes with a pool (``heartbeat_age_s`` is the
        executor's: the core does not know the links)."""
        envs: dict[str, int] = {}
        for env in self.envs:
            if env.node and env.state not in ("closing", "closed"):
                envs[env.node] = envs.get(env.node, 0) + 1
        return [
            {
                "name": p.node_id,
                "state": "draining" if self.cpu.is_draining(p.node_id) else "ready",
                "mem_gb": round(p.mem_total / (1 << 30), 3),
                "envs": envs.get(p.node_id, 0),
                "running": len(p.actions()),
                "id": p.node_id,
                "cores": p.capacity,
                "free_cores": p.free_units(),
                "numa": [list(c) for c in p.numa],
                "mem_bytes": p.mem_total,
                "mem_reserved": p.mem_reserved,
                "busy_cores": [c for cores in p.numa for c in cores if p.holder(c) is not None],
                "gpus": self._gpu_count(p.node_id),
            }
            for p in self.cpu.nodes
        ]

    def node_work(self, node: str) -> dict[str, Any]:
        """What the core expects of one node (cluster reconciliation after a reconnect):
        the environments it still owns, those being created (with image and memory) or
        removed there, and the exec actions running there."""
        keep: list[str] = []
        creating: list[dict[str, Any]] = []
        closing: list[str] = []
        for env in self.envs:
            if env.node != node or env.lost_node:
                continue
            if env.state == "closing":
                closing.append(env.id)
            elif env.state in ("ready", "creating", "lost"):
                keep.append(env.id)
                if env.state == "creating":
                    creating.append({"env_id": env.id, "image": env.image, "mem": env.mem})
        pool_id = f"cpu:{node}"
        running = [
            rec.action.id
            for rec in self.actions.values()
            if rec.state == "running" and rec.action.kind == "exec" and rec.pool_id == pool_id
        ]
        return {"keep": keep, "creating": creating, "closing": closing, "running": running}

    def env_record(self, env_id: str) -> dict[str, Any] | None:
        """A persistent environment as the coordinator stores it (None: gone, throwaway,
        or not yet created)."""
        env = self.envs.get(env_id)
        if env is None or env.throwaway or env.state not in ("ready", "lost"):
            return None
        return {
            "id": env.id,
            "trajectory": env.trajectory,
            "node": env.node,
            "image": env.image,
            "mem": env.mem,
            "lost_node": env.lost_node,
        }

    def env_node(self, env_id: str) -> str | None:
        """The node holding an environment (None: unknown or not placed)."""
        env = self.envs.get(env_id)
        return env.node if env is not None and env.node else None

    def exec_reply(self, action_id: str) -> tuple[int, float] | None:
        """A running exec's reply token and time queued: what a cluster node needs to answer
        the client itself as this core's reply would (None: no reply pending)."""
        rec = self.actions.get(ActionId(action_id))
        if rec is None or rec.state != "running" or rec.token is None or rec.call is not None:
            return None
        return rec.token, (rec.started_at or rec.submitted_at) - rec.submitted_at

    def action_node(self, action_id: str) -> str | None:
        """The node a running exec action runs on (None: not running)."""
        rec = self.actions.get(ActionId(action_id))
        if rec is None or rec.state != "running" or not rec.pool_id.startswith("cpu:"):
            return None
        return rec.pool_id[len("cpu:") :]

    def _gpu_count(self, node_id: str) -> int:
        gpu = self.gpu
        if gpu is None or node_id not in {node.node_id for node in gpu.nodes}:
            return 0
        return gpu.node(node_id).n_gpus

    def service_waiting(self) -> dict[str, int]:
        """Queued calls per service."""
        waiting: dict[str, int] = {}
        for rec in self.queue.values():
            if rec.call is not None:
                waiting[rec.call.name] = waiting.get(rec.call.name, 0) + 1
        return waiting

    def profile(self, name: str) -> dict[str, Any]:
        prof = self.profiles.get(name)
        if prof is None:
            raise NotFound(f"profile {name!r} not found")
        return {"name": name, **prof}

    def profile_rows(self) -> list[dict[str, Any]]:
        return [{"name": n, **p} for n, p in sorted(self.profiles.items())]

    def total_cores(self) -> int:
        return sum(p.capacity for p in self.cpu.nodes)

    def env_ids(self, *, throwaway_only: bool = False, persistent_only: bool = False) -> list[str]:
        return [
            env.id
            for env in self.envs
            if not (throwaway_only and not env.throwaway)
            and not (persistent_only and env.throwaway)
        ]

    # ------------------------------------------------------------------ invariants
    def validate(self) -> None:
        """Invariants every test checks after each event."""
        for node in self.cpu.nodes:
            node.validate()
        holders: dict[tuple[str, int], ActionId] = {}  # (pool, core): cores are per node
        for rec in self.actions.values():
            if rec.state == "running" and rec.action.kind == "exec":
                for core in rec.units:
                    key = (rec.pool_id, core)
                    assert key not in holders, (
                        f"core {core} of {rec.pool_id} held by {holders[key]} and {rec.action.id}"
                    )
                    holders[key] = rec.action.id
            assert rec.state != "done", f"ended action {rec.action.id} still live"
            if rec.env is not None:
                assert self.envs.get(rec.env) is not None, f"{rec.action.id}: env gone"
        for aid in self.queue:
            assert self.actions[aid].state == "queued"
        for env in self.envs:
            for aid in env.pending:
                assert self.actions[aid].state == "waiting_env", f"{aid} pending on {env.id}"
        for pool in self.apis.values():
            assert pool.free_units() >= 0
        if self.gpu is not None:
            self.gpu.validate()
            for rec in self.actions.values():
                if rec.state == "running" and rec.action.kind == "service":
                    held = self.gpu.held(rec.action.id)
                    assert held == tuple(rec.units), f"{rec.action.id} holds {held}"


def _recent_summary(finished: deque[tuple[str, float, float]]) -> dict[str, dict[str, float]]:
    """Mean queue / exec / ACT seconds per action kind over the recent finished actions."""
    acc: dict[str, list[float]] = {}
    for kind, queue_s, exec_s in finished:
        row = acc.setdefault(kind, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += queue_s
        row[2] += exec_s
    return {
        kind: {"count": int(n), "queue_s": q / n, "exec_s": x / n, "act_s": (q + x) / n}
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

# Events after which the cached affinity (``Core._affinity``) still holds: besides these,
# a ``SubmitExec`` into a named environment (no session) opens, moves or removes none.
# Events after which the cached idle bound (``Core._idle_due``) is still a lower bound of
# the earliest idle deadline: they only end idleness, or start it at ``now`` (the deadline
# then is ``now + ttl``, which ``_finish_action`` folds in). Any other event drops it.
_KEEP_IDLE_BOUND: frozenset[type] = frozenset({ev.SubmitExec, ev.ExecFinished, ev.Tick})
# (the same set, less SubmitExec, keeps the affinity; see ``Core.handle``)

_HANDLERS: dict[type, Callable[[Core, Any, float, list[ev.Command]], None]] = {
    ev.SubmitExec: Core._submit_exec,
    ev.OpenEnv: Core._open,
    ev.CloseEnv: Core._close,
    ev.EnvCreated: Core._env_created,
    ev.EnvRemoved: Core._env_removed,
    ev.ExecFinished: Core._exec_done,
    ev.AcquireLease: Core._acquire,
    ev.ReleaseLease: Core._release,
    ev.SaveProfile: Core._save_profile,
    ev.ProfilesLoaded: Core._profiles_loaded,
    ev.EnvsRecovered: Core._envs_recovered,
    ev.PutFile: Core._put_file,
    ev.GetFile: Core._get_file,
    ev.TransferDone: Core._transfer_done,
    ev.OpenSession: Core._open_session,
    ev.SessionOpened: Core._session_opened,
    ev.InterruptSession: Core._interrupt_session,
    ev.CloseSession: Core._close_session,
    ev.SessionClosed: Core._session_closed,
    ev.RegisterService: Core._register_service,
    ev.ServiceLoaded: Core._service_loaded,
    ev.ServicesRecovered: Core._services_recovered,
    ev.RemoveService: Core._remove_service,
    ev.ServiceUnloaded: Core._service_unloaded,
    ev.SubmitCall: Core._submit_call,
    ev.CallFinished: Core._call_done,
    ev.ConnClosed: Core._conn_closed,
    ev.NodeJoined: Core._node_joined,
    ev.NodeLost: Core._node_lost,
    ev.DrainNode: Core._drain_node,
    ev.EnvsRestored: Core._envs_restored,
    ev.Tick: lambda c, e, now, out: c._tick(now, out),
    ev.Shutdown: Core._shutdown,
}
