"""The router: one entry point over the books, and the scheduling pass.

``Core.handle(event, now) -> list[Command]`` is the only way the daemon's state changes.
It gives the event a stimulus id, looks up the event type's handler in the dispatch table
(:mod:`tangramd.state.dispatch`; each module of :mod:`tangramd.state.handlers` registers
its own), and returns the commands the handler produced, each carrying that id as
``cause``. The executor (``tangramd.executor``) runs the commands and feeds each result
back as a new event. ``now`` is always an argument: the core never awaits, sleeps or reads
the clock, so tests and the simulator drive it synchronously.

The books, one per resource, each with its records and its transition table (births
included), and no handler:

- actions (:mod:`~tangramd.state.actions`): live actions, the FCFS queue, recent outcomes;
- environments (:mod:`~tangramd.state.envs`): memory, placement, the wait for memory;
- sessions (:mod:`~tangramd.state.sessions`), leases (:mod:`~tangramd.state.leases`),
  services (:mod:`~tangramd.state.services`), and what passes remember
  (:mod:`~tangramd.state.passes`).

What each event does to them is a handler in :mod:`tangramd.state.handlers`, typed
against :class:`tangramd.state.context.Core` (the protocol this class implements), so
the handlers never import this module. Views are the read model (``core.read``,
:mod:`~tangramd.state.views`).

In ``tangramd up`` this one core is both the coordinator (queues, registry, global
scheduler) and, through its environment book, the node's bookkeeping: the all-in-one
mode. A coordinator runs the same core over its nodes' pools.

Scheduling passes are coalesced: arrivals and completions only mark the pass book
*dirty*, and a pass is due at once when none ran in the last ``coalesce_s`` (0 by
default: always), else at the end of that window. The executor decides when a due pass
runs: at the end of the event loop's turn (every event read in that turn shares it), or at
once after a completion (see ``Executor._arm_timer``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from typing import Any

from tangram.model import EnvId, HistoryEstimator, TangramError
from tangram.pools.api import ApiPool
from tangram.pools.cpu import CpuCluster
from tangram.pools.gpu import GpuCluster
from tangram.protocol.errors import EnvLost, InfraError, NotFound
from tangram.sched import LoadMeter
from tangramd import events as ev
from tangramd.state.actions import ActionBook, ActionRec
from tangramd.state.config import CoreConfig
from tangramd.state.dispatch import HANDLERS
from tangramd.state.envs import EnvBook, EnvDefaults, EnvRec
from tangramd.state.handlers import (  # noqa: F401  (each registers its handlers)
    actions,
    envs,
    jobs,
    leases,
    nodes,
    profiles,
    router,
    scheduling,
    services,
    sessions,
)
from tangramd.state.jobstats import JobStats
from tangramd.state.leases import LeaseBook
from tangramd.state.passes import PassBook
from tangramd.state.services import ServiceBook
from tangramd.state.sessions import SessionBook
from tangramd.state.story import Stories
from tangramd.state.views import ReadModel


class Core:
    """The router over the books of ``tangramd up``, a node or a coordinator."""

    def __init__(
        self,
        cpu: CpuCluster,
        apis: Mapping[str, ApiPool],
        config: CoreConfig | None = None,
        history: HistoryEstimator | None = None,
        gpu: GpuCluster | None = None,
        new_env_id: Callable[[], EnvId] | None = None,
    ) -> None:
        """``new_env_id``: where environment ids come from (default: 128 random bits each,
        ``envs.random_env_id``); a test that runs two cores side by side gives both the same
        deterministic source."""
        self.cfg = config or CoreConfig()
        self.cpu = cpu
        self.apis = dict(apis)
        self.gpu = gpu
        self.pools: dict[str, Any] = {p.pool_id: p for p in cpu.nodes}
        self.pools.update({p.pool_id: p for p in self.apis.values()})
        if gpu is not None:
            self.pools[gpu.pool_id] = gpu
        self.history = history or HistoryEstimator(default_s=1.0)
        self.meter = LoadMeter()  # recent offered load per CPU node (the "priced" rule)
        self.stories = Stories()
        defaults = EnvDefaults(
            mem=self.cfg.default_env_mem,
            image=self.cfg.default_image,
            idle_ttl_s=self.cfg.env_idle_ttl_s,
            owned_by_peer=self.cfg.exec_as_peer,
        )
        # the books
        self.actions = ActionBook(self.stories)
        self.envs = EnvBook(cpu, defaults, self.stories, new_env_id)
        self.sessions = SessionBook(self.envs, self.stories)
        self.leases = LeaseBook()
        self.services = ServiceBook()
        self.profiles: dict[str, dict[str, Any]] = {}
        self.passer = PassBook()
        self.read = ReadModel(self)
        self.shutting_down = False
        self.stimulus = 0  # id of the event being handled
        self._stimuli = itertools.count(1)
        self._ids = itertools.count(1)
        # a lower bound of the earliest idle deadline (None: scan the environments)
        self.idle_due: float | None = None
        # jobs (issue 34): every job an action was submitted under (two or more: passes
        # read the whole queue in fair-share order) and each job's recent ACTs (``jobs`` op,
        # kept across restarts: tangramd.state.jobstats)
        self.jobs_seen: set[str] = set(self.cfg.jobs)
        self.job_stats = JobStats()

    # ------------------------------------------------------------------ entry point
    def handle(self, event: ev.Event, now: float) -> list[ev.Command]:
        self.stimulus = next(self._stimuli)
        out: list[ev.Command] = []
        kind = type(event)
        if kind not in _KEEP_IDLE_BOUND:
            self.idle_due = None
            self.passer.affinity = None  # environments may open, move or go
        elif isinstance(event, ev.SubmitExec) and (event.spec.env is None or event.spec.session):
            self.passer.affinity = None  # a throwaway environment opens
        try:
            HANDLERS[kind](self, event, now, out)
        except TangramError as exc:
            token = getattr(event, "token", None)
            if token is None:
                raise
            out.append(self.reply(token, error=(exc.code, exc.message)))
        passer = self.passer
        if passer.dirty and passer.due is None:
            passer.due = max(now, passer.last + self.cfg.coalesce_s)
        return out

    def run_pass(self, now: float, out: list[ev.Command]) -> None:
        scheduling.run_pass(self, now, out)

    def next_wakeup(self, now: float) -> float | None:
        """Earliest time the executor must feed a ``Tick``."""
        times = [
            t
            for t in (
                self.passer.due,
                self.actions.deadlines.first(),
                self.envs.deadlines.first(),
                self.job_stats.due,
                self.passer.windows.first(),  # an API's quota window opens
            )
            if t is not None
        ]
        times += self.leases.wakeups()
        batch_due = self.services.batch_due()
        if batch_due is not None:
            times.append(batch_due)
        idle = self.idle_due
        if idle is None or idle <= now:
            idle = self.idle_due = min(self.envs.idle_deadlines(), default=math.inf)
        if idle != math.inf:
            times.append(idle)
        return min(times) if times else None

    @property
    def passes(self) -> int:
        return self.passer.passes

    # ------------------------------------------------------------------ for the books
    def new_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):x}"

    def reply(
        self, token: int, result: Any = None, error: tuple[str, str] | None = None
    ) -> ev.Reply:
        return ev.Reply(token=token, result=result, error=error, cause=self.stimulus)

    def enqueue(self, rec: ActionRec, now: float) -> None:
        """An action is ready to be scheduled: queue it and mark a pass due."""
        self.actions.enqueue(rec, now, self.stimulus)
        self.passer.dirty = True
        if rec.action.kind == "exec" and rec.env is not None:  # the priced rule's forecast
            env = self.envs.get(rec.env)
            if env is not None and env.node:
                self.meter.submitted(f"cpu:{env.node}", now, rec.action.elastic)

    def ready_env(self, env_id: str, peer: tuple[int, int] | None = None) -> EnvRec:
        """An environment ``peer`` may use and that is ready (else a typed error)."""
        env = self.envs.open_env(env_id, peer)
        if env is None:
            if (lost := self.envs.lost_error(env_id, peer)) is not None:
                raise EnvLost(lost)
            raise NotFound(f"environment {env_id!r} not found")
        if env.state != "ready":
            raise InfraError(f"environment {env_id} is {env.state}, not ready")
        return env

    def idle_from(self, now: float) -> None:
        """An environment became idle at ``now``: fold its idle deadline into the bound."""
        if self.idle_due is not None:
            self.idle_due = min(self.idle_due, now + self.envs.defaults.idle_ttl_s)

    # ------------------------------------------------------------------ invariants
    def validate(self) -> None:
        """Invariants every test checks after each event."""
        for node in self.cpu.nodes:
            node.validate()
        holders: dict[tuple[str, int], str] = {}  # (pool, core): cores are per node
        for rec in self.actions:
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
        for aid in self.actions.queue:
            assert self.actions[aid].state == "queued"
        for env in self.envs:
            for aid in env.pending:
                assert self.actions[aid].state == "waiting_env", f"{aid} pending on {env.id}"
        for pool in self.apis.values():
            assert pool.free_units() >= 0
        if self.gpu is not None:
            self.gpu.validate()
            for rec in self.actions:
                if rec.state == "running" and rec.action.kind == "service":
                    held = self.gpu.held(rec.action.id)
                    assert held == tuple(rec.units), f"{rec.action.id} holds {held}"


# Events after which the cached idle bound (``Core.idle_due``) is still a lower bound of
# the earliest idle deadline: they only end idleness, or start it at ``now`` (the deadline
# then is ``now + ttl``, which ``finish_action`` folds in). Any other event drops it. The
# same set, less a SubmitExec that opens a throwaway environment or uses a session, keeps
# the cached affinity (``PassBook.affinity``).
_KEEP_IDLE_BOUND: frozenset[type] = frozenset({ev.SubmitExec, ev.ExecFinished, ev.Tick})
