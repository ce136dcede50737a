"""The simulator's three baselines (docs/design.md §8), each replacing tangram for one
resource kind.

- ``K8sPods`` (CPU): one pod of ``k8s_pod_cores`` cores per trajectory, created FCFS at the
  trajectory's first exec action when a node has the cores and memory (spread: the node with
  most free cores), ready ``k8s_pod_start_s`` later, held until the trajectory ends. Every
  exec action runs in its pod at the largest allowed amount that fits it. Optional: the
  kube-scheduler binds at most ``k8s_sched_pods_per_s`` pods a second (0: unlimited), and
  every exec pays ``k8s_exec_overhead_s`` (the ``kubectl exec`` round trip) before it runs.
- ``StaticServices`` (GPU): ``static_replicas`` replicas of ``static_gpus`` GPUs per used
  service, deployed first-fit decreasing at start, each serving one call at a time (FCFS).
- ``ApiRetry`` (API): each call tries to take a lease; a refused call backs off
  ``api_retry_backoff_s`` doubling up to ``MAX_BACKOFF_S`` and tries again.

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
        allowed = action.allowed_units()
        if allowed[0] > self.cores:
            self.host.fail_run(run, now)  # the action needs more cores than a pod has
            return
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
    """``free`` idle replicas of ``gpus`` GPUs each, FCFS queue."""

    gpus: int
    replicas: int
    free: int
    queue: deque[Run] = field(default_factory=deque)


class StaticServices:
    """Fixed service replicas on the GPU nodes (see module doc)."""

    def __init__(self, host: Host, trajectories: Sequence[Trajectory]) -> None:
        self.host = host
        cluster = host.cluster
        used = sorted({a.template.service or "" for t in trajectories for a in t.actions()} - {""})
        free = [g.gpus for g in cluster.gpu_nodes for _ in range(g.count)]
        self.services: dict[str, _Replicas] = {}
        demands = []
        for name in used:
            spec = cluster.service(name)
            assert spec is not None  # the engine checked the trace's names
            demands += [(spec.static_gpus, name)] * spec.static_replicas
            self.services[name] = _Replicas(
                spec.static_gpus, spec.static_replicas, spec.static_replicas
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
        svc.free += 1
        self._dispatch(svc, now)

    def _dispatch(self, svc: _Replicas, now: float) -> None:
        while svc.free and svc.queue:
            run = svc.queue.popleft()
            svc.free -= 1
            self.host.start_run(run, now, svc.gpus, 0.0, "gpu")

    def validate(self) -> None:
        for svc in self.services.values():
            assert 0 <= svc.free <= svc.replicas, "static replicas over-used"


class ApiRetry:
    """Per-trajectory API calls that retry with exponential back-off (see module doc)."""

    def __init__(self, host: Host, apis: dict[str, ApiPool], retry_kind: int) -> None:
        self.host = host
        self.apis = apis
        self.retry_kind = retry_kind
        self.backoff_s = host.cluster.baselines.api_retry_backoff_s

    def attempt(self, run: Run, now: float) -> None:
        pool = self.apis[run.action.key]
        pool.advance(now)
        if pool.acquire(LeaseId(str(run.action.id)), now, ttl_s=NO_TTL) is not None:
            self.host.start_run(run, now, 1, 0.0, run.action.key)
            return
        backoff = min(self.backoff_s * 2**run.attempts, MAX_BACKOFF_S)
        run.attempts += 1
        self.host.push(now + backoff, self.retry_kind, run)

    def done(self, run: Run, now: float) -> None:
        self.apis[run.action.key].release_lease(LeaseId(str(run.action.id)))
        self.host.add_reserved(run.action.key, run.exec)
