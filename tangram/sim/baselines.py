"""The simulator's three baselines (docs/design.md §8), each replacing tangram for one
resource kind.

- ``K8sPods`` (CPU): one pod of ``k8s_pod_cores`` cores per trajectory, created FCFS at the
  trajectory's first exec action when a node has the cores and memory (spread: the node with
  most free cores), ready ``k8s_pod_start_s`` later, held until the trajectory ends. Every
  exec action runs in its pod at the largest allowed amount that fits it. Optional: the
  kube-scheduler binds at most ``k8s_sched_pods_per_s`` pods a second (0: unlimited), and
  every exec pays ``k8s_exec_overhead_s`` (the ``kubectl exec`` round trip) before it runs.
- ``StaticServices`` (GPU): ``static_replicas`` replicas of ``static_gpus`` GPUs per used
  service, deployed first-fit decreasing at start. With ``static_max_batch = 1`` each serves
  one call at a time (FCFS). With ``B > 1`` each batches continuously, as SGLang does: a
  call joins its replica's running batch as soon as fewer than ``B`` calls run there (FCFS
  over the service's replicas, the least loaded first) and leaves when it is done. The
  per-call time comes from the same service time model as tangram's: a call alone on the
  ``g``-GPU replica takes ``t(g)`` (the trace's duration at ``g`` GPUs); with ``n`` calls in
  the batch every call progresses ``1 + rho (n - 1)`` times slower, with
  ``rho = E(g) / static_batch_gain`` (``E(g) = t(1) / (g t(g))``), so a full batch's
  throughput per GPU approaches ``static_batch_gain`` times one call alone on one GPU
  (processor sharing, recomputed at every arrival and departure). tangram's own batching
  (``tangram.sim.gpubatch``, a service's ``max_batch``) times its passes with this model.
- ``ApiRetry`` (API): each call tries to take a lease; a refused call backs off
  ``api_retry_backoff_s`` doubling up to ``MAX_BACKOFF_S`` and tries again. Under ``k8s``
  an exec that also holds an API slot (a trace's ``api`` on an exec) does the same from its
  pod, whose cores wait meanwhile: no joint admission there.

They use the same pure pools as tangram for bookkeeping (so capacity is checked the same
way) and never touch the scheduler. They drive the run through the engine's small ``Host``
interface: start an action, fail it, schedule an event.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tangram.model import ActionId, EnvId, LeaseId
from tangram.pools.api import ApiPool
from tangram.pools.cpu import CpuNodePool, pick_cores
from tangram.sim.cluster import ClusterSpec
from tangram.sim.runs import Run, Traj
from tangram.sim.trace import Trajectory

MAX_BACKOFF_S = 30.0
NO_TTL = 1e15  # api-retry leases are released explicitly when the call returns


class SimError(Exception):
    """The trace and the cluster do not go together (or a baseline cannot be deployed)."""


class Host(Protocol):
    """What a baseline needs from the engine that drives it."""

    cluster: ClusterSpec

    def start_run(
        self, run: Run, now: float, units: int, restore: float, resource: str, delay: float = 0.0
    ) -> None: ...

    def fail_run(self, run: Run, now: float) -> None: ...

    def push(self, time: float, kind: int, obj: object) -> None: ...

    def add_reserved(self, resource: str, unit_seconds: float) -> None: ...

    def add_busy(self, resource: str, unit_seconds: float) -> None: ...

    def finish_run(self, run: Run, now: float) -> None: ...


class K8sPods:
    """Per-trajectory pods on the CPU nodes (see module doc)."""

    def __init__(
        self,
        host: Host,
        nodes: Sequence[CpuNodePool],
        env_bytes: dict[str, int],
        kinds: tuple[int, int],
    ) -> None:
        self.host = host
        self.nodes = list(nodes)
        self.env_bytes = env_bytes
        self.ready_kind, self.bind_kind = kinds  # event kinds: pod ready, scheduler free
        b = host.cluster.baselines
        self.cores = b.k8s_pod_cores
        self.start_s = b.k8s_pod_start_s
        self.bind_s = 1.0 / b.k8s_sched_pods_per_s if b.k8s_sched_pods_per_s > 0 else 0.0
        self.exec_s = b.k8s_exec_overhead_s
        self.queue: deque[Traj] = deque()
        self.dirty = False
        self.api: ApiRetry | None = None  # how an exec with an API slot gets it (the engine's)
        self._bind_free_at = 0.0  # when the (serial) kube-scheduler can bind the next pod
        self._bind_wake = False

    def submit(self, run: Run, now: float) -> None:
        st = run.traj
        if st.pod is None:
            st.pending = run
            self.queue.append(st)
            self.dirty = True
            return
        self._start(run, now)

    def _start(self, run: Run, now: float) -> None:
        action = run.action
        if action.allowed_units()[0] > self.cores:
            self.host.fail_run(run, now)  # the action needs more cores than a pod has
            return
        if action.extra and self.api is not None:
            # cores and an API slot (the trace's "api"): the command in the pod calls the
            # API and, refused, backs off and tries again; its pod's cores wait meanwhile
            self.api.attempt(run, now)
            return
        self.run_in_pod(run, now)

    def run_in_pod(self, run: Run, now: float) -> None:
        """Run the exec in its trajectory's pod, at the largest allowed amount that fits."""
        action = run.action
        allowed = action.allowed_units()
        amount = max(a for a in allowed if a <= self.cores) if action.is_elastic() else allowed[0]
        self.host.start_run(run, now, amount, 0.0, "cpu", delay=self.exec_s)

    def create_pods(self, now: float) -> None:
        """Bind queued pods FCFS while a node has room for the head one."""
        self.dirty = False
        cores = self.cores
        while self.queue:
            st = self.queue[0]
            mem = self.env_bytes[st.spec.id]
            fits = [n for n in self.nodes if n.free_units() >= cores and n.mem_free >= mem]
            if now < self._bind_free_at:  # the kube-scheduler is busy: bind later
                if not self._bind_wake:
                    self._bind_wake = True
                    self.host.push(self._bind_free_at, self.bind_kind, None)
                return
            if not fits:
                if not any(n.capacity >= cores and n.mem_total >= mem for n in self.nodes):
                    self.queue.popleft()  # can never be scheduled
                    run, st.pending = st.pending, None
                    assert run is not None
                    self.host.fail_run(run, now)
                    continue
                return  # FCFS: the head waits for room
            self.queue.popleft()
            node = max(fits, key=lambda n: (n.free_units(), -int(n.node_id[1:])))  # spread
            picked = pick_cores(node.free_by_numa(), cores)
            node.allocate(ActionId(f"pod:{st.spec.id}"), picked)
            node.reserve_mem(EnvId(st.spec.id), mem)
            st.pod = (node, picked, now)
            self._bind_free_at = now + self.bind_s
            self.host.push(now + self.start_s, self.ready_kind, st)

    def on_bind_free(self, _obj: object, now: float) -> None:
        self._bind_wake = False
        self.dirty = True

    def on_ready(self, st: Traj, now: float) -> None:
        run, st.pending = st.pending, None
        assert run is not None
        self._start(run, now)

    def end(self, st: Traj, now: float) -> None:
        """The trajectory ended: delete its pod."""
        if st.pod is None:
            return
        node, _cores, created = st.pod
        node.release(ActionId(f"pod:{st.spec.id}"))
        node.unreserve_mem(EnvId(st.spec.id))
        self.host.add_reserved("cpu", self.cores * (now - created))
        st.pod = None
        self.dirty = True


@dataclass(slots=True)
class _Replicas:
    """``free`` idle replicas of ``gpus`` GPUs each, FCFS queue; with batching, the calls
    in each replica's batch."""

    gpus: int
    replicas: int
    free: int
    queue: deque[Run] = field(default_factory=deque)
    batches: list[_Batch] = field(default_factory=list)


@dataclass(slots=True)
class _Batch:
    """One continuously batching replica: each running call's remaining solo seconds."""

    gpus: int
    runs: dict[ActionId, Run] = field(default_factory=dict)
    left: dict[ActionId, float] = field(default_factory=dict)
    rho: dict[ActionId, float] = field(default_factory=dict)  # the call's E(g) / batch gain
    since: float = 0.0  # when ``left`` was last brought up to date
    version: int = 0  # a completion event carries it; a stale one is ignored

    def slowdown(self) -> float:
        """How many times slower than alone each call runs now (the batch's mean rho)."""
        n = len(self.left)
        if n <= 1:
            return 1.0
        return 1.0 + (n - 1) * sum(self.rho.values()) / n

    def advance(self, now: float) -> float:
        """Bring ``left`` up to ``now``; the seconds the replica was busy meanwhile."""
        busy = 0.0
        if self.left:
            busy = now - self.since
            done = busy / self.slowdown()
            for aid in self.left:
                self.left[aid] -= done
        self.since = now
        return busy

    def next_done(self) -> tuple[float, ActionId] | None:
        if not self.left:
            return None
        aid = min(self.left, key=lambda a: (self.left[a], self.runs[a].action.seq))
        return self.since + max(self.left[aid], 0.0) * self.slowdown(), aid


class StaticServices:
    """Fixed service replicas on the GPU nodes (see module doc)."""

    def __init__(
        self, host: Host, trajectories: Sequence[Trajectory], batch_kind: int = -1
    ) -> None:
        self.host = host
        cluster = host.cluster
        self.max_batch = cluster.baselines.static_max_batch
        self.gain = cluster.baselines.static_batch_gain
        self.batch_kind = batch_kind  # event kind of a batched call's completion
        used = sorted({a.template.service or "" for t in trajectories for a in t.actions()} - {""})
        free = [g.gpus for g in cluster.gpu_nodes for _ in range(g.count)]
        self.services: dict[str, _Replicas] = {}
        demands = []
        for name in used:
            spec = cluster.service(name)
            assert spec is not None  # the engine checked the trace's names
            demands += [(spec.static_gpus, name)] * spec.static_replicas
            self.services[name] = _Replicas(
                spec.static_gpus,
                spec.static_replicas,
                spec.static_replicas,
                batches=[_Batch(spec.static_gpus) for _ in range(spec.static_replicas)],
            )
        need = sum(g for g, _ in demands)
        for gpus, name in sorted(demands, key=lambda d: -d[0]):  # first fit decreasing
            slot = next((i for i, f in enumerate(free) if f >= gpus), None)
            if slot is None:
                raise SimError(
                    f"static-services: cluster {cluster.source} is too small: the "
                    f"replicas of {', '.join(used)} need {need} GPUs, it has "
                    f"{cluster.total_gpus} (could not place a {gpus}-GPU replica of {name!r})"
                )
            free[slot] -= gpus
        self.gpus = need  # held for the whole run

    def submit(self, run: Run, now: float) -> None:
        svc = self.services[run.action.service or ""]
        svc.queue.append(run)
        self._dispatch(svc, now)

    def done(self, run: Run, now: float) -> None:
        svc = self.services[run.action.service or ""]
        if self.max_batch == 1:
            svc.free += 1
        self._dispatch(svc, now)

    def _dispatch(self, svc: _Replicas, now: float) -> None:
        if self.max_batch > 1:
            self._join(svc, now)
            return
        while svc.free and svc.queue:
            run = svc.queue.popleft()
            svc.free -= 1
            self.host.start_run(run, now, svc.gpus, 0.0, "gpu")

    # ------------------------------------------------------------------ continuous batching

    def _join(self, svc: _Replicas, now: float) -> None:
        """Queued calls join the least loaded replica's batch while one has room."""
        touched: set[int] = set()
        while svc.queue:
            i, batch = min(enumerate(svc.batches), key=lambda ib: (len(ib[1].left), ib[0]))
            if len(batch.left) >= self.max_batch:
                break
            run = svc.queue.popleft()
            if i not in touched:
                self._advance(batch, now)
                touched.add(i)
            alone = run.ta.true_duration(svc.gpus)
            eff = run.ta.true_duration(1) / (svc.gpus * alone) if alone > 0 else 1.0
            run.start, run.units, run.restore = now, svc.gpus, 0.0
            aid = run.action.id
            batch.runs[aid], batch.left[aid] = run, alone
            batch.rho[aid] = min(eff / self.gain, 1.0)
        self._reschedule(svc, touched)

    def _advance(self, batch: _Batch, now: float) -> None:
        busy = batch.advance(now)
        if busy > 0:
            self.host.add_busy("gpu", batch.gpus * busy)

    def _reschedule(self, svc: _Replicas, touched: set[int]) -> None:
        for i in sorted(touched):
            batch = svc.batches[i]
            batch.version += 1
            nxt = batch.next_done()
            if nxt is not None:
                self.host.push(nxt[0], self.batch_kind, (svc, i, batch.version))

    def on_batch_done(self, event: tuple[_Replicas, int, int], now: float) -> None:
        """The next call of a replica's batch is done (unless the batch changed since):
        it leaves the batch and the engine ends it (``done`` then lets a queued call in)."""
        svc, i, version = event
        batch = svc.batches[i]
        if version != batch.version:
            return
        self._advance(batch, now)
        nxt = batch.next_done()
        assert nxt is not None, "a current completion event implies a running call"
        aid = nxt[1]
        run = batch.runs.pop(aid)
        del batch.left[aid], batch.rho[aid]
        run.exec = now - run.start
        self._reschedule(svc, {i})
        self.host.finish_run(run, now)

    def validate(self) -> None:
        for svc in self.services.values():
            assert 0 <= svc.free <= svc.replicas, "static replicas over-used"
            for batch in svc.batches:
                assert len(batch.left) <= self.max_batch, "a batch over its size"


class ApiRetry:
    """Per-trajectory API calls that retry with exponential back-off (see module doc)."""

    def __init__(self, host: Host, apis: dict[str, ApiPool], retry_kind: int) -> None:
        self.host = host
        self.apis = apis
        self.retry_kind = retry_kind
        self.backoff_s = host.cluster.baselines.api_retry_backoff_s
        self.pods: K8sPods | None = None  # where an exec with an API slot runs (k8s)

    def attempt(self, run: Run, now: float) -> None:
        """Take a slot of the call's API (an ``api`` action's, or an exec's with ``api``: it
        then runs in its pod, ``pods``); refused, try again after the back-off."""
        key = _api_of(run)
        pool = self.apis[key]
        pool.advance(now)
        if pool.acquire(LeaseId(str(run.action.id)), now, ttl_s=NO_TTL) is not None:
            if run.action.kind == "api":
                self.host.start_run(run, now, 1, 0.0, key)
            else:
                assert self.pods is not None, "an exec with an API slot runs in a k8s pod"
                self.pods.run_in_pod(run, now)
            return
        backoff = min(self.backoff_s * 2**run.attempts, MAX_BACKOFF_S)
        run.attempts += 1
        self.host.push(now + backoff, self.retry_kind, run)

    def done(self, run: Run, now: float) -> None:
        key = _api_of(run)
        self.apis[key].release_lease(LeaseId(str(run.action.id)))
        self.host.add_reserved(key, run.exec)


def _api_of(run: Run) -> str:
    """The API pool a retried call holds a slot of: an ``api`` action's own, or the one an
    exec names with ``api`` (its ``extra``)."""
    action = run.action
    return action.key if action.kind == "api" else action.extra[0][0]
