"""Discrete-event simulator (docs/design.md §8): the real scheduler and pure pools, a virtual clock.

Contract
--------
``simulate(cluster, trajectories, policy) -> SimResult`` replays a trace under one policy.
The engine is the *driver* of ``tangram.sched.schedule`` and the pools of ``tangram.pools``,
exactly like the daemon: it builds a ``Snapshot``, applies the ``Decision`` with
``allocate``/``release``/``reserve_mem``/``restore_for``, and feeds observed durations into a
``HistoryEstimator``. Baselines (``k8s`` pods, ``static-services`` replicas, ``api-retry``)
live in ``tangram.sim.baselines``; the engine routes the actions they manage to them.

Events sit in one heap ordered by ``(time, priority, sequence)``: deterministic, with no
wall clock and no randomness (generators draw randomness up front from a seed). All events
of one timestamp are handled first; then one scheduling pass runs over the pools whose state
changed (an action arrived in their queue or one of theirs released units). While some
trajectory waits without a node, a pass also reads every CPU node for the node choice; a
full node's queue is left out (it can start nothing), and so is a *quiet* node's: its last
pass found no candidate, nothing on it changed since, and the scheduler's bound
(``Decision.quiet``) says the clock alone cannot change that yet. Both leave the decisions
as they would be with every queue in the pass.

``passes="touched"`` (``Engine``, ``simulate``; ``"all"`` is the default above) leaves out
more: a CPU node whose state did not change and that has not the memory free for any
node-less trajectory (so the node choice cannot give it one) is in the pass for the node
choice only, whatever its last pass found. The rule of a pass with no node-less trajectory
then holds throughout. Not the same decisions: an elastic action a node held back (its
candidates all sent back by the eviction step) is looked at again at that node's next
event, not at the next event anywhere, so it may start later. Where memory never binds,
every node with a queue has the memory free and the two modes decide alike
(``tests/test_sim_passes.py``); at 10× touched is about 9× faster (docs/results.md). Lean
passes only (one job, no caps, no decayed usage, no joint demands), as for quiet nodes.

Trajectories alternate generation time and actions. Each RL task runs its steps in order:
step ``k+1`` of a task starts ``step_train_s`` after the last trajectory of its step ``k``
finished; a trajectory arrives ``arrival_s`` after its step's start.
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from tangram.model import Action, ActionId, Choices, EnvId, HistoryEstimator, Range
from tangram.pools.api import ApiPool
from tangram.pools.cpu import CpuNodePool
from tangram.pools.gpu import GpuCluster, GpuNodePool
from tangram.pools.gpu import ServiceSpec as GpuServiceSpec
from tangram.sched import Decision, LoadMeter, SchedConfig, Snapshot
from tangram.sched.schedule import schedule
from tangram.sched.share import DecayedUsage, Job, pool_totals
from tangram.sim.baselines import ApiRetry, K8sPods, SimError, StaticServices
from tangram.sim.cluster import GB, ClusterSpec
from tangram.sim.gpubatch import GpuBatcher
from tangram.sim.metrics import ActionRecord, SimResult, summarize
from tangram.sim.policy import Policy
from tangram.sim.runs import Run, Traj
from tangram.sim.trace import TraceAction, Trajectory

# event kinds, in the order they are handled within one timestamp
DONE, POD_READY, RETRY, GEN_DONE, ARRIVE, WAKE, POD_BIND, BATCH_DONE = range(8)

_SEQ = operator.attrgetter("seq")
PASSES = ("all", "touched")  # Engine(passes=...): which CPU node queues a pass runs
_V = TypeVar("_V")


class _OnDemand(Mapping[str, _V]):
    """A snapshot map built on demand: ``make(key)`` for a key of ``keys``, once. The pass
    reads a pool's running actions and load only where it runs that pool's queue (a pool
    with a queue and a free unit), not for every pool it could give a new trajectory to."""

    __slots__ = ("_got", "_keys", "_make")

    def __init__(self, keys: Collection[str], make: Callable[[str], _V]) -> None:
        self._keys = keys
        self._make = make
        self._got: dict[str, _V] = {}

    def __getitem__(self, key: str) -> _V:
        got = self._got.get(key)
        if got is None:
            if key not in self._keys:
                raise KeyError(key)
            got = self._got[key] = self._make(key)
        return got

    def get(self, key: str, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class Engine:
    """One simulated run of a trace under a policy (see module doc)."""

    def __init__(
        self,
        cluster: ClusterSpec,
        trajectories: Sequence[Trajectory],
        policy: Policy,
        sched: SchedConfig | None = None,
        *,
        check: bool = False,
        progress: Callable[[float, int, int], None] | None = None,
        jobs: Mapping[str, Job] | None = None,
        quiet: bool = True,
        passes: str = "all",
        schedule_fn: Callable[[Snapshot, float, SchedConfig], Decision] | None = None,
        on_start: Callable[[Run, float, int], None] | None = None,
    ) -> None:
        if passes not in PASSES:
            raise ValueError(f"passes: {passes!r} is not one of {', '.join(PASSES)}")
        self.cluster = cluster
        # "touched": while trajectories wait node-less, a pass runs only the queues of the
        # CPU nodes whose state changed (see the module doc); "all": every CPU node's
        # queue (the default: the decisions the stored results were made with)
        self.touched = passes == "touched"
        # the pass (``schedule``; a tool may wrap it, e.g. to time it: bench/paper/table1.py)
        # and how many it ran
        self._schedule = schedule if schedule_fn is None else schedule_fn
        self.passes = 0
        # called at every start with (run, now, units): tests and tools that log them
        self.on_start = on_start
        # leave out the queues of CPU nodes whose last pass found no candidate while the
        # scheduler says none would be found again (Decision.quiet; see _pass). False: every
        # pass runs them (the same decisions, tests/test_sim_quiet.py)
        self.use_quiet = quiet
        # jobs' terms (fair share, tangram.sched.share) and the units each job holds now
        self.jobs: dict[str, Job] = dict(jobs or {})
        self.held: dict[str, dict[str, int]] = {}
        self.policy = policy
        self.sched = replace(
            sched or SchedConfig(order=policy.order, rule=policy.rule),
            quiet=quiet and not self.touched,  # (touched: a node left out is not re-run)
        )
        # decayed usage per job (share_half_life_s > 0), advanced by the virtual clock
        h = self.sched.share_half_life_s
        self.decay: DecayedUsage | None = DecayedUsage(h) if h > 0.0 else None
        self.check = check
        self.progress = progress
        _check_names(cluster, trajectories)
        self._heap: list[tuple[float, int, int, int, Any]] = []
        self._eseq = 0
        self._seq = 0
        self._tick = 0
        self.now = 0.0
        self.records: list[ActionRecord] = []
        self.step_durations: dict[str, list[float]] = {}
        self.busy: dict[str, float] = {}
        self.reserved: dict[str, float] = {}
        self.history = HistoryEstimator(default_s=1.0)
        self._templates: dict[int, Action] = {}
        self._build_pools()
        self._build_steps(trajectories)
        self._n_traj = len(trajectories)
        self._done_traj = 0

    # ------------------------------------------------------------------ setup

    def _build_pools(self) -> None:
        c = self.cluster
        self.cpu: dict[str, CpuNodePool] = {}
        i = 0
        for spec in c.cpu_nodes:
            per = spec.cores // spec.numa
            for _ in range(spec.count):
                layout = [list(range(n * per, (n + 1) * per)) for n in range(spec.numa)]
                node = CpuNodePool(f"c{i}", layout, int(spec.mem_gb * GB))
                self.cpu[node.pool_id] = node
                i += 1
        gnodes: list[GpuNodePool] = []
        for gspec in c.gpu_nodes:
            for _ in range(gspec.count):
                gnodes.append(
                    GpuNodePool(
                        f"g{len(gnodes)}",
                        gspec.gpus,
                        mem_per_gpu=int(gspec.gpu_mem_gb * GB),
                        h2d_bytes_per_s=gspec.h2d_gbps * GB,
                    )
                )
        services = {s.name: GpuServiceSpec(s.name, int(s.mem_gb * GB)) for s in c.services}
        self.gpu = GpuCluster(gnodes, services) if gnodes else None
        self.apis: dict[str, ApiPool] = {
            f"api:{a.name}": ApiPool(a.name, a.concurrency, a.quota, a.period_s) for a in c.apis
        }
        self.pools: dict[str, Any] = dict(self.cpu)
        if self.gpu is not None:
            self.pools[self.gpu.pool_id] = self.gpu
        self.pools.update(self.apis)
        self._cpu_ids = frozenset(self.cpu)
        self.totals = pool_totals(self.pools)
        # scheduler-side state
        self.queues: dict[str, dict[ActionId, Run]] = {pid: {} for pid in self.pools}
        self.unassigned: dict[ActionId, Run] = {}
        # unassigned actions by environment memory (bytes -> how many), and those submitted
        # since the last pass: while no node has the memory free for the smallest of them,
        # the pass leaves out all but the new ones (see _pass)
        self._unassigned_mem: dict[int, int] = {}
        self._fresh: list[Run] = []
        self.running: dict[str, dict[ActionId, tuple[float, int]]] = {p: {} for p in self.pools}
        self.affinity: dict[Any, str] = {}
        self.envs_on: dict[str, int] = {}  # CPU node -> trajectories living there (envs)
        self.env_bytes: dict[str, int] = {}
        # an environment's memory, for the scheduler's node choice (called once per waiting
        # trajectory per pass: a closure over the dict's get, no attribute lookups)
        get_env = self.env_bytes.get
        self._env_mem: Callable[[Action], int] = lambda action: get_env(action.trajectory, 0)
        self.dirty: set[str] = set()
        self._joint = False  # an action with units on several pools was submitted
        # Whether a pass may leave out the queues of full CPU nodes (see _pass): one job, no
        # caps, no decayed usage and no joint demands, so the pass reads no action beyond
        # its own pool's queue (fair_order returns None). Cleared for good when not.
        self._lean = self.decay is None and not any(
            j.max_cores is not None or j.max_gpus is not None for j in self.jobs.values()
        )
        self._job0: str | None = None
        # per CPU node: the runs queued on it since its queue last went into a pass (the
        # scheduler's never-fits check has not seen them)
        self._unchecked: dict[str, list[Run]] = {}
        # the most free memory of a CPU node (-1: to be read again). Only the scheduler's
        # placements and trajectory ends reserve and free it while trajectories wait
        # node-less (the k8s baseline reserves its own, but sends none to the scheduler).
        self._mem_most = -1
        # per CPU node whose last pass found no candidate: (until when the scheduler finds
        # none at the same state, the oldest entry of its load window, the estimates it read
        # as Decision.quiet gives them); dropped when the node's state changes (it is dirty)
        self._quiet: dict[str, tuple[float, float, tuple[tuple[str, float, float], ...]]] = {}
        self.quiet_skips = 0  # node queues left out so (tests, bench/paper/sim_scale.py)
        self.touched_skips = 0  # untouched node queues left out (passes="touched")
        self.meter = LoadMeter()  # recent offered load per CPU node, for the "priced" rule
        self._wakes: set[tuple[str, float]] = set()
        # baselines (set up in _build_steps once the trace is known)
        self.k8s = K8sPods(self, list(self.cpu.values()), self.env_bytes, (POD_READY, POD_BIND))
        self.retry = ApiRetry(self, self.apis, RETRY)
        self.k8s.api, self.retry.pods = self.retry, self.k8s
        self.static: StaticServices | None = None
        # tangram's dynamic batching of service calls (a service with max_batch > 1)
        enabled = self.policy.gpu != "static" and GpuBatcher.enabled(c)
        self.batcher = GpuBatcher(self, c, DONE) if enabled else None

    def _build_steps(self, trajectories: Sequence[Trajectory]) -> None:
        groups: dict[tuple[str, int], list[Traj]] = {}
        for t in trajectories:
            st = Traj(t, group=(t.task, t.step))
            groups.setdefault(st.group, []).append(st)
            self.env_bytes[t.id] = int(t.mem_gb * GB)
        self._groups = groups
        self._left = {g: len(v) for g, v in groups.items()}
        self._next_step: dict[tuple[str, int], tuple[str, int] | None] = {}
        by_task: dict[str, list[int]] = {}
        for task, step in sorted(groups):
            by_task.setdefault(task, []).append(step)
        for task, steps in by_task.items():
            for a, b in zip(steps, [*steps[1:], None], strict=True):
                self._next_step[(task, a)] = None if b is None else (task, b)
        self._step_start: dict[tuple[str, int], float] = {}
        if self.policy.gpu == "static":
            self.static = StaticServices(self, trajectories, BATCH_DONE)
        for task, steps in by_task.items():
            self._start_step((task, steps[0]), 0.0)

    # ------------------------------------------------------------------ event loop

    def push(self, time: float, kind: int, obj: Any) -> None:
        self._eseq += 1
        heapq.heappush(self._heap, (time, kind, self._eseq, kind, obj))

    def run(self) -> SimResult:
        heap = self._heap
        handlers: dict[int, Callable[[Any, float], None]] = {
            DONE: self._on_done,
            POD_READY: self.k8s.on_ready,
            RETRY: self.retry.attempt,
            GEN_DONE: self._on_gen_done,
            ARRIVE: self._on_gen_done,
            WAKE: self._on_wake,
            POD_BIND: self.k8s.on_bind_free,
            BATCH_DONE: self._on_batch_done,
        }
        events = 0
        while heap:
            now = heap[0][0]
            self.now = now
            while heap and heap[0][0] == now:
                _, _, _, kind, obj = heapq.heappop(heap)
                handlers[kind](obj, now)
                events += 1
            if self.dirty or self.unassigned:
                self._pass(now)
            if self.k8s.dirty:
                self.k8s.create_pods(now)
            if self.check:
                self._validate()
            if self.progress is not None and events >= 2000:
                self.progress(now, self._done_traj, self._n_traj)
                events = 0
        return self._finish()

    # ------------------------------------------------------------------ trajectories

    def _start_step(self, group: tuple[str, int], at: float) -> None:
        self._step_start[group] = at
        for st in self._groups[group]:
            self.push(at + st.spec.arrival_s, ARRIVE, st)

    def _on_gen_done(self, st: Traj, now: float) -> None:
        steps = st.spec.steps
        while st.idx < len(steps):
            s = steps[st.idx]
            st.idx += 1
            if isinstance(s, TraceAction):
                self._submit(st, s, now)
                return
            if s > 0:
                self.push(now + s, GEN_DONE, st)
                return
        self._end_trajectory(st, now)

    def _end_trajectory(self, st: Traj, now: float) -> None:
        self._done_traj += 1
        tid = st.spec.id
        self.k8s.end(st, now)
        pid = self.affinity.pop(st.spec.id, None)
        if pid is not None:
            self.envs_on[pid] -= 1
            self.cpu[pid].unreserve_mem(EnvId(tid))
            self._mem_most = -1
            self.dirty.add(pid)  # memory freed: a new trajectory may fit now
        group = st.group
        self._left[group] -= 1
        if self._left[group] == 0:
            start = self._step_start[group]
            task = group[0]
            train = self.cluster.step_train_s
            self.step_durations.setdefault(task, []).append(now - start + train)
            nxt = self._next_step[group]
            if nxt is not None:
                self._start_step(nxt, now + train)

    # ------------------------------------------------------------------ actions

    def _template(self, ta: TraceAction) -> Action:
        key = id(ta)
        tpl = self._templates.get(key)
        if tpl is None:
            tpl = ta.template
            k = self.policy.fixed_dop
            if k is not None and tpl.is_elastic():
                allowed = tpl.allowed_units()
                fit = [a for a in allowed if a <= k]
                amount = fit[-1] if fit else allowed[0]
                amounts = Range(amount, amount) if tpl.key == "cpu" else Choices((amount,))
                tpl = replace(tpl, demand={**tpl.demand, tpl.key: amounts})
            self._templates[key] = tpl
        return tpl

    def _submit(self, st: Traj, ta: TraceAction, now: float) -> None:
        self._seq += 1
        tpl = self._template(ta)
        action = replace(
            tpl, id=ActionId(f"{st.spec.id}#{st.idx - 1}"), seq=self._seq, submitted_at=now
        )
        run = Run(action, ta, st, now)
        if action.extra:
            self._joint = True
            self._lean = False
        if self._job0 != action.job:
            if self._job0 is not None:
                self._lean = False  # a second job: fair share reads every waiting action
            self._job0 = action.job
        pol = self.policy
        if ta.kind == "exec":
            if pol.cpu == "k8s":
                self.k8s.submit(run, now)
                return
            pid = self.affinity.get(st.spec.id)
            if pid is None:
                self.unassigned[action.id] = run
                self._fresh.append(run)
                need = self.env_bytes.get(st.spec.id, 0)
                self._unassigned_mem[need] = self._unassigned_mem.get(need, 0) + 1
            else:
                self.queues[pid][action.id] = run
                self.dirty.add(pid)
                self.meter.submitted(pid, now, action.elastic)
                got = self._unchecked.get(pid)
                if got is None:
                    self._unchecked[pid] = [run]
                else:
                    got.append(run)
        elif ta.kind == "service":
            if self.static is not None:
                self.static.submit(run, now)
                return
            self.queues["gpu"][action.id] = run
            self.dirty.add("gpu")
        else:
            pid = action.key
            if pol.api == "retry":
                self.retry.attempt(run, now)
                return
            self.queues[pid][action.id] = run
            self.dirty.add(pid)

    def start_run(
        self, run: Run, now: float, units: int, restore: float, resource: str, delay: float = 0.0
    ) -> None:
        """Start ``run`` on ``units`` units; ``delay`` seconds of dispatch cost (counted as
        queueing) come before its restore and execution."""
        if self.on_start is not None:
            self.on_start(run, now, units)
        run.start = now + delay
        run.units = units
        run.restore = restore
        run.exec = run.ta.true_duration(units)
        self.add_busy(resource, units * run.exec)
        self.push(run.start + restore + run.exec, DONE, run)

    def finish_run(self, run: Run, now: float) -> None:
        """A baseline ends ``run`` now (its times are set): handled as its ``DONE``."""
        self.push(now, DONE, run)

    def _on_batch_done(self, event: Any, now: float) -> None:
        assert self.static is not None, "batched calls imply static-services"
        self.static.on_batch_done(event, now)

    def _usage(self, now: float, waiting: list[Action]) -> dict[str, dict[str, float]] | None:
        """Each job's decayed usage at ``now`` (None: the memoryless share, half-life 0)."""
        if self.decay is None:
            return None
        weights = {name: job.weight for name, job in self.jobs.items()}
        return self.decay.update(now, self.held, {a.job for a in waiting}, weights)

    def _on_done(self, run: Run, now: float) -> None:
        action = run.action
        if run.ta.dur_s is not None:
            self.history.observe(action.klass, run.exec)
        pid = run.pool_id
        if pid:  # placed by the scheduler: give the units back
            self.meter.finished(pid, action.id)
            pool = self.pools[pid]
            pool.release(action.id)
            for also, _ in action.extra:  # the units it held with them (joint admission)
                self.pools[also].release(action.id)
                self.dirty.add(also)
                self.dirty |= self._cpu_ids  # an exec waiting for that unit may start
            held = self.held[action.job]
            held[pool.resource] -= run.units
            del self.running[pid][action.id]
            self.dirty.add(pid)
            self.add_reserved(self.pools[pid].resource, run.units * (now - run.start))
        elif action.kind == "service" and self.static is not None:  # a static replica
            self.static.done(run, now)
        elif action.kind == "api" or action.extra:  # an api-retry lease (a k8s exec's too)
            self.retry.done(run, now)
        self._record(run, now, failed=False)
        self._on_gen_done(run.traj, now)

    def _record(self, run: Run, now: float, failed: bool) -> None:
        start = run.start if run.start >= 0 else now
        self.records.append(
            ActionRecord(
                str(run.action.id),
                run.ta.tag,
                run.action.kind,
                run.action.task,
                start - run.submit,
                run.restore,
                run.exec,
                run.units,
                failed,
                run.action.job,
                start,
            )
        )

    def fail_run(self, run: Run, now: float) -> None:
        self._record(run, now, failed=True)
        self._on_gen_done(run.traj, now)

    # ------------------------------------------------------------------ scheduler pass

    def _pass(self, now: float) -> None:
        # The waiting actions in submission order: the unassigned ones and each pool's queue
        # are each in seq order (dicts keep insertion order, seq grows with submission), so
        # the sort merges sorted runs. A placed or failed action's run is found again in
        # ``unassigned`` or its pool's queue (no per-pass map of every waiting run).
        pools: dict[str, Any] = {}
        waiting: list[Action] = []  # the node-less ones that go in, then the queued ones
        unassigned = self.unassigned
        cut = -1  # >= 0: node-less actions past this seq were left out (but the fresh ones)
        fresh = self._fresh
        lean = self._lean
        dirty = self.dirty
        apis, queues, all_pools, cpu = self.apis, self.queues, self.pools, self.cpu
        # whether the unassigned actions take part in the node choice (all CPU nodes in)
        nodeless = bool(unassigned)
        touched = self.touched and lean
        if unassigned:
            if not touched:
                dirty = dirty | self._cpu_ids
            most = self._mem_most
            if most < 0:  # memory was reserved or freed since it was last read
                most = self._mem_most = max([n.mem_free for n in cpu.values()])
            if min(self._unassigned_mem) > most:
                # No node has the memory free for any of them: the scheduler gives none a
                # node (tangram.sched.schedule._assign_nodes), so only those new since the
                # last pass go in, for its never-fits check (a cluster's capacities do not
                # change: one that passed it once passes it again). Same decisions; the
                # pass no longer reads every node-less trajectory (~15,000 at 10x).
                if fresh:
                    waiting.extend([r.action for r in fresh if r.action.id in unassigned])
                nodeless = bool(waiting)
            elif lean:
                cut = self._nodeless_head(waiting, fresh, 0)
            else:
                waiting.extend([r.action for r in unassigned.values()])
        self._fresh = []
        smallest = 0  # the least memory of a node-less trajectory (passes="touched")
        if touched and nodeless:  # (in for the node choice; their queues only if dirty)
            dirty = dirty | self._cpu_ids
            smallest = min(self._unassigned_mem)
        heads = len(waiting)
        # A full CPU node is in a pass with node-less actions for the node choice only (a
        # starving trajectory may be given a node whose cores are busy): a pool with no
        # free unit places nothing, so its queue is left out (it was read every pass: ~40%
        # of the queued actions at 10x), as are its running actions and its load. Only
        # its actions the never-fits check has not seen go in (the same failures at the
        # same times). The same decisions; not with several jobs, caps, decayed usage or
        # joint demands (they read the whole queue), where the queues all go in as before.
        unchecked = self._unchecked
        full: set[str] = set()
        left_out = False  # a queued action was left out (without it, the pass had run)
        # A CPU node whose last pass found no candidate (nothing could start) and whose
        # state has not changed since (not dirty: no arrival, release, start or memory
        # freed; its load's window has lost no entry) finds none before the time the
        # scheduler gave (Decision.quiet: the starvation bound, a short call's bypass and
        # the next expected finish are all it reads of the clock): its queue, running
        # actions and load are left out, as a full node's are. Should the node choice give
        # it a node-less trajectory, the pass runs again with its queue (below). Same
        # decisions; lean passes only (one job: no action is read beyond its own queue).
        quiet = self._quiet
        changed = self.dirty
        for pid in changed:
            quiet.pop(pid, None)
        skipped: list[str] = []
        window = self.meter.window_s
        estimate = self.history.estimate
        use_quiet = lean and self.use_quiet
        for pid in sorted(dirty):
            pool = all_pools[pid]
            if pid in apis:
                pool.advance(now)
            queue = queues[pid]
            if not queue and not nodeless:
                continue
            if pool.free_units() == 0:
                if not (nodeless and pid in cpu):
                    continue  # nothing can start here until something is released
                if lean:
                    pools[pid] = pool
                    full.add(pid)
                    new = unchecked.pop(pid, None)
                    if new:
                        waiting.extend([r.action for r in new if r.action.id in queue])
                    left_out = left_out or bool(queue)
                    continue
            if (
                touched
                and pid not in changed
                and pid in cpu
                and pid not in unchecked
                and cpu[pid].mem_free < smallest
            ):
                # passes="touched": in for the node choice only, which cannot give it a
                # node-less trajectory (none's memory is free there); as a quiet node
                pools[pid] = pool
                skipped.append(pid)
                self.touched_skips += 1
                left_out = left_out or bool(queue)
                continue
            got = quiet.get(pid) if use_quiet else None
            if got is not None:
                if (
                    now < got[0]
                    and got[1] > now - window
                    and pid not in unchecked
                    and _holds(got[2], estimate, now)
                ):
                    pools[pid] = pool
                    skipped.append(pid)
                    self.quiet_skips += 1
                    left_out = left_out or bool(queue)
                    continue
                del quiet[pid]
            pools[pid] = pool
            waiting.extend([r.action for r in queue.values()])
            if pid in unchecked:
                del unchecked[pid]
        self.dirty = set()
        if not waiting:
            if left_out:  # the pass had run (and placed nothing): its API wake-ups
                for pid in apis:
                    if queues[pid]:
                        self._api_wake(pid, now)
            return
        for action in waiting if self._joint else ():  # joint demands: read their pools too
            for also, _ in action.extra:
                if also not in pools and also in all_pools:
                    pools[also] = all_pools[also]
        queued = waiting[heads:]
        head = waiting[:heads]  # the node-less ones
        waiting.sort(key=_SEQ)
        on = self.running
        meter, envs_on = self.meter, self.envs_on
        out = full.union(skipped)

        def live(pid: str) -> bool:
            return pid not in out

        def running(pid: str) -> list[tuple[float, int]]:
            return list(on[pid].values())

        def load(pid: str) -> Any:
            return meter.load(pid, now, envs_on.get(pid, 0))

        snap = Snapshot(
            waiting=waiting,
            pools=pools,
            affinity=self.affinity,
            running=_OnDemand([pid for pid in pools if live(pid)], running),
            estimate=self.history.estimate,
            env_mem=self._env_mem,
            # A pool's load is read (and its window pruned) at the passes that run its
            # queue, which include every pass where it starts an action (the meter's only
            # sums): pruning lazily pops the same entries in the same order between two
            # additions, so the loads read are the same as when every node was read.
            load=_OnDemand([pid for pid in pools if live(pid) and pid in cpu], load),
            jobs=self.jobs,
            held=self.held,
            totals=self.totals,
            usage=self._usage(now, waiting),
        )
        while True:
            decision = self._schedule(snap, now, self.sched)
            self.passes += 1
            while cut >= 0 and not self._head_covers(decision, cut):
                # the memory left after the head could have gone to one left out: again
                # with four times as many (a pure pass, nothing applied yet; the loads read
                # are those of the same instant)
                head = []
                cut = self._nodeless_head(head, fresh, 4 * heads)
                heads = len(head)
                waiting = [*head, *queued]
                waiting.sort(key=_SEQ)
                decision = self._schedule(replace(snap, waiting=waiting), now, self.sched)
                self.passes += 1
            if not skipped or not any(pid in skipped for _, pid in decision.assigned):
                break
            # a node left out as quiet was given a node-less trajectory: its first action
            # joins that queue, so the pass runs again with every such queue in
            # (passes="touched" leaves out only nodes the node choice cannot pick)
            for pid in skipped:
                out.discard(pid)
                quiet.pop(pid, None)
                queued.extend([r.action for r in queues[pid].values()])
            skipped = []
            waiting = [*head, *queued]
            waiting.sort(key=_SEQ)
            snap = replace(
                snap,
                waiting=waiting,
                running=_OnDemand([pid for pid in pools if live(pid)], running),
                load=_OnDemand([pid for pid in pools if live(pid) and pid in cpu], load),
            )
        if self.use_quiet and decision.quiet:
            # (not where the pass gave a node-less action a node it did not place: its
            # queue had that action, which stays node-less)
            gave = {pid for _, pid in decision.assigned}
            for pid, until, reads in decision.quiet:
                if pid in cpu and pid not in gave:
                    quiet[pid] = (until, meter.oldest(pid, now), reads)
        mem_free: dict[str, int] = {}  # per node this pass: free memory, kept up to date
        placing: set[ActionId] = set()  # batching: the calls this pass places or fails
        if self.batcher is not None:  # ride in no batch
            placing = {p.action_id for p in decision.placements}
            placing |= {inf.action_id for inf in decision.infeasible}
        for p in decision.placements:
            pid = p.pool_id
            if p.new_node:
                run = unassigned[p.action_id]
                action = run.action
                tid = action.trajectory
                node = cpu[pid]
                need = self.env_bytes[tid]
                free = mem_free.get(pid)
                if free is None:
                    free = mem_free[pid] = node.mem_free
                if need > free:  # what reserve_mem would refuse, without summing the node
                    continue  # memory not free after all: the action keeps waiting
                if not node.reserve_mem(EnvId(tid), need):
                    continue  # (not reached: the check above is reserve_mem's)
                mem_free[pid] = free - need
                self._mem_most = -1
                self.affinity[tid] = pid
                self.envs_on[pid] = self.envs_on.get(pid, 0) + 1
                del unassigned[action.id]
                self._forget_unassigned(need)
                self.meter.submitted(pid, run.submit, action.elastic)
            else:
                run = queues[pid].pop(p.action_id)
                action = run.action
            pool = all_pools[pid]
            pool.allocate(action.id, p.units)
            for also, units in p.also:  # joint admission: its other units, together
                all_pools[also].allocate(action.id, units)
            run.pool_id = pid
            restore = 0.0
            if action.kind == "service":
                self._tick += 1
                assert self.gpu is not None
                plan = self.gpu.restore_for(action.id, action.service or "", self._tick)
                restore = plan.seconds
            self.running[pid][action.id] = (now + p.expected_s, p.amount)
            if pid in cpu:
                self.meter.started(pid, action.id, now, action.elastic, p.amount, p.expected_s)
            if self.batcher is not None and action.kind == "service":
                end = self.batcher.start(run, now, len(p.units), restore, queues[pid], placing)
                if end is not None:  # riders came along: the pass ends later
                    self.running[pid][action.id] = (end, p.amount)
            else:
                self.start_run(run, now, len(p.units), restore, pool.resource)
            held = self.held.get(action.job)
            if held is None:
                held = self.held[action.job] = {}
            held[pool.resource] = held.get(pool.resource, 0) + len(p.units)
        for inf in decision.infeasible:
            failed = unassigned.pop(inf.action_id, None)
            if failed is None:
                failed = self._pop_queued(inf.action_id)
            else:
                self._forget_unassigned(self.env_bytes.get(failed.action.trajectory, 0))
            self.fail_run(failed, now)
        # (an exec waiting for an API slot with its cores is in a CPU queue, not the API's)
        joint = {also for a in waiting for also, _ in a.extra} if self._joint else set()
        for pid in apis:
            if queues[pid] or pid in joint:
                self._api_wake(pid, now)

    def _nodeless_head(self, into: list[Action], fresh: list[Run], at_least: int) -> int:
        """Put the first node-less actions into ``into`` (FCFS order), as many as could
        take the memory free now twice over and 64 more (at least ``at_least``), and those
        submitted since the last pass (the never-fits check). Returns the seq of the last
        of the first ones when some were left out, else -1 (all went in).

        A pass gives a node only to an action whose environment's memory some node has
        free (``tangram.sched.schedule._assign_nodes``), in FCFS order, and each node it
        gives takes that memory: once the actions before those left out have left no node
        the memory of the smallest environment waiting, the ones left out would have been
        given none either (``_head_covers`` checks it on the pass's ``assigned``), and
        the pass is the one that reads them all. Most of the time memory frees for one
        environment at a time (a trajectory ended), and the first starving trajectory takes
        it: the pass reads ~70 node-less actions, not ~15,000 (10x)."""
        unassigned = self.unassigned
        smallest = min(self._unassigned_mem)
        if smallest > 0:
            slots = sum([n.mem_free // smallest for n in self.cpu.values()])
            take = max(2 * slots + 64, at_least)
        else:  # environments without memory: any of them may be given a node
            take = len(unassigned)
        if take >= len(unassigned):
            into.extend([r.action for r in unassigned.values()])
            return -1
        into.extend([r.action for r in itertools.islice(unassigned.values(), take)])
        last = into[-1].seq
        new = [r.action for r in fresh if r.action.seq > last and r.action.id in unassigned]
        into.extend(new)
        return last if take + len(new) < len(unassigned) else -1

    def _head_covers(self, decision: Any, last: int) -> bool:
        """Whether, after the node-less actions up to seq ``last`` were given their nodes
        by ``decision`` (placed or queued there), no node has the memory of the smallest
        environment still node-less: then the ones left out of the pass could not have been
        given a node, in the pass that reads them all either (the same decision)."""
        left = {pid: node.mem_free for pid, node in self.cpu.items()}
        unassigned, env_bytes = self.unassigned, self.env_bytes
        for aid, pid in decision.assigned:
            run = unassigned.get(aid)
            if run is not None and run.action.seq <= last:
                left[pid] -= env_bytes.get(run.action.trajectory, 0)
        return max(left.values()) < min(self._unassigned_mem)

    def _forget_unassigned(self, need: int) -> None:
        left = self._unassigned_mem[need] - 1
        if left:
            self._unassigned_mem[need] = left
        else:
            del self._unassigned_mem[need]

    def _pop_queued(self, aid: ActionId) -> Run:
        """Remove a queued (not unassigned) action's run from its pool's queue."""
        for queue in self.queues.values():
            run = queue.pop(aid, None)
            if run is not None:
                return run
        raise KeyError(aid)

    def _api_wake(self, pid: str, now: float) -> None:
        at = self.apis[pid].next_grant_time(now)
        if at is not None and at > now and (pid, at) not in self._wakes:
            self._wakes.add((pid, at))
            self.push(at, WAKE, pid)

    def _on_wake(self, pid: str, now: float) -> None:
        self._wakes.discard((pid, now))
        self.dirty.add(pid)
        if self._joint:  # the execs that wait for a slot of it are in the CPU queues
            self.dirty |= self._cpu_ids

    # ------------------------------------------------------------------ bookkeeping

    def add_busy(self, resource: str, unit_seconds: float) -> None:
        self.busy[resource] = self.busy.get(resource, 0.0) + unit_seconds

    def add_reserved(self, resource: str, unit_seconds: float) -> None:
        self.reserved[resource] = self.reserved.get(resource, 0.0) + unit_seconds

    def _validate(self) -> None:
        for node in self.cpu.values():
            node.validate()
            assert node.free_units() >= 0
        if self.gpu is not None:
            self.gpu.validate()
        for api in self.apis.values():
            api.validate()
        if self.static is not None:
            self.static.validate()

    def _finish(self) -> SimResult:
        pending = len(self.unassigned) + sum(len(q) for q in self.queues.values())
        if pending or self._done_traj != self._n_traj:
            raise SimError(
                f"simulation stalled at t={self.now:.3f}: {pending} actions still queued, "
                f"{self._n_traj - self._done_traj} trajectories unfinished"
            )
        makespan = self.now
        if self.static is not None and self.static.services:
            self.add_reserved("gpu", self.static.gpus * makespan)
        return summarize(
            self.policy.name, self.records, self.step_durations, self.busy, self.reserved, makespan
        )


def _holds(
    reads: tuple[tuple[str, float, float], ...], estimate: Callable[[str], float], now: float
) -> bool:
    """Whether the short calls a quiet node's pass held by a reservation on the history
    estimate of their class (``Decision.quiet``) are held still: the estimate (their
    duration, a CPU node adding nothing) above the reservation they were held by, and
    behind an elastic action's reservation, not yet waited that long (with the margin of
    ``tangram.sched.schedule._quiet_until``)."""
    for klass, held_by, since in reads:
        d = estimate(klass) + 0.0
        if not d > held_by:
            return False
        if since < math.inf:
            at = since + d
            if not now < at - 1e-6 * max(1.0, abs(at)):
                return False
    return True


def pool_of_run(run: Run, affinity: Any) -> str:
    a = run.action
    if a.kind == "exec":
        return str(affinity[a.trajectory])
    return "gpu" if a.kind == "service" else a.key


def _check_names(cluster: ClusterSpec, trajectories: Sequence[Trajectory]) -> None:
    for t in trajectories:
        for a in t.actions():
            tpl = a.template
            if tpl.kind == "service" and cluster.service(tpl.service or "") is None:
                raise SimError(
                    f"trajectory {t.id!r} calls service {tpl.service!r}, which cluster file "
                    f"{cluster.source} does not define (services: "
                    f"{', '.join(s.name for s in cluster.services) or 'none'})"
                )
            names = [tpl.api or ""] if tpl.kind == "api" else [p[4:] for p, _ in tpl.extra]
            for name in names:  # (an exec's are the APIs it holds with its cores)
                if cluster.api(name) is None:
                    raise SimError(
                        f"trajectory {t.id!r} calls API {name!r}, which cluster file "
                        f"{cluster.source} does not define (APIs: "
                        f"{', '.join(a.name for a in cluster.apis) or 'none'})"
                    )


def simulate(
    cluster: ClusterSpec,
    trajectories: Sequence[Trajectory],
    policy: Policy,
    sched: SchedConfig | None = None,
    *,
    check: bool = False,
    progress: Callable[[float, int, int], None] | None = None,
    jobs: Mapping[str, Job] | None = None,
    passes: str = "all",
    schedule_fn: Callable[[Snapshot, float, SchedConfig], Decision] | None = None,
) -> SimResult:
    """Run one policy over a trace; see the module doc. ``jobs``: the jobs' terms (weight,
    priority, caps) for fair share across the trace's jobs; a job not named has weight 1.
    ``passes``: ``"all"`` or ``"touched"`` (the module doc); ``schedule_fn``: the pass to
    call instead of ``schedule`` (one that wraps it, to time it)."""
    return Engine(
        cluster,
        trajectories,
        policy,
        sched,
        check=check,
        progress=progress,
        jobs=jobs,
        passes=passes,
        schedule_fn=schedule_fn,
    ).run()


__all__ = ["Engine", "SimError", "simulate"]
