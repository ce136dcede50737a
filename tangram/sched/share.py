"""Fair share across jobs (issue 34 item 2): the order in which one pass offers freed units.

Contract
--------
``fair_order(waiting, jobs, held, totals, resource_of)`` reorders the waiting queue (FCFS
order in) so that the per-pool pass (``tangram.sched.schedule``), which serves its queue in
the order given, hands freed units to the job furthest below its weighted share:

- a higher ``Job.priority`` comes first, strictly: every waiting action of a priority-1 job
  is offered before any of a priority-0 job's;
- within one priority, weighted dominant-resource fairness (DRF) by progressive filling: a
  job's share is ``max over resources r of (units of r it holds) / (units of r in the
  cluster)``, divided by its weight; the next action offered is the head of the job with the
  smallest share, and its minimum key amount is then counted as held, so a job of weight 2
  gets two actions offered for each one of a job of weight 1 once both are at their share;
  ties go to the earlier head (FCFS across jobs);
- within a job, FCFS order is kept (the current rule decides what and how much starts);
- ``max_cores`` / ``max_gpus`` cap what a job holds: the head that would pass its job's cap
  (at its minimum) and every later action of that job wait this pass; an action whose
  minimum alone exceeds the cap can never run and is returned as infeasible.

``held`` is what each job's running actions hold now (driver-provided: an elastic action
above its minimum counts all its units against its job). Nothing running is ever preempted:
shares are restored at action boundaries. Pure: no I/O, no clock.

Decayed usage (``[sched] share_half_life_s`` = H > 0): the share counts, instead of the
units held now, ``usage`` (job -> resource -> units): an exponentially decayed average of
the units the job held, half-life H, kept by ``DecayedUsage`` from the ``now`` and the
``held`` each pass is given (the driver's clock, passed in: the core reads none); the
units offered in the pass are added to it as before. A job that held less than its share
recently is then offered units first when it comes back. Caps still count the units held
now. H = 0 (``usage`` None): the memoryless rule above, exactly.

Returns ``None`` when there is nothing to reorder (the waiting actions belong to one job and
it has no cap): the pass then is exactly the single-job pass.

Cost: ``O(q log j)`` for ``q`` waiting actions of ``j`` jobs (one heap operation per action
offered while two or more jobs still have actions, a list extend after that).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tangram.model import Action, Shortfall, TrajectoryId
from tangram.sched.pool import SchedPool

DEFAULT_JOB = "default"


@dataclass(frozen=True, slots=True)
class Job:
    """One job's terms: ``[[job]]`` in the config or in ``tangramctl simulate --jobs``."""

    name: str
    weight: float = 1.0
    priority: int = 0
    max_cores: int | None = None  # None: no cap
    max_gpus: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("job.name: expected a non-empty string")
        if not self.weight > 0.0 or self.weight != self.weight or self.weight == float("inf"):
            raise ValueError(f"job.weight: expected a positive finite number, got {self.weight}")
        for key, cap in (("max_cores", self.max_cores), ("max_gpus", self.max_gpus)):
            if cap is not None and cap < 0:
                raise ValueError(f"job.{key}: expected a non-negative integer, got {cap}")

    def cap(self, resource: str) -> int | None:
        if resource == "cpu":
            return self.max_cores
        if resource == "gpu":
            return self.max_gpus
        return None


def resource_of(action: Action) -> str:
    """The resource an action's key amount is counted in: "cpu", "gpu" or "api:<name>"."""
    kind = action.kind
    if kind == "exec":
        return "cpu"
    if kind == "service":
        return "gpu"
    return action.key


def pool_totals(pools: Mapping[str, SchedPool]) -> dict[str, int]:
    """Units per resource over ``pools`` (the jobs' shares are fractions of these)."""
    out: dict[str, int] = {}
    for pool in pools.values():
        r = pool.resource
        out[r] = out.get(r, 0) + pool.capacity
    return out


def dominant_share(
    held: Mapping[str, int], totals: Mapping[str, int], weight: float = 1.0
) -> float:
    """max over resources of held / total, divided by ``weight`` (0 where nothing is held)."""
    best = 0.0
    for r, units in held.items():
        total = totals.get(r, 0)
        if total > 0 and units > 0:
            f = units / total
            if f > best:
                best = f
    return best / weight


class DecayedUsage:
    """job -> resource -> the units it held, exponentially averaged with half-life ``H`` s.

    ``update(now, held, waiting, weights)`` advances the averages from the previous call's
    ``now`` to this one, taking ``held`` (the units held now) as what each job held over
    that interval: ``avg <- held + (avg - held) * 2 ** (-(now - last) / H)``.

    A job is *active* while it holds units or has actions waiting (``waiting``: the names of
    the jobs with waiting actions). A job that becomes active while others already are
    starts no lower than they stand, weight for weight: per resource, its average is raised
    to the least of theirs times its weight over theirs. Idle time earns no credit (as a
    waking task in a fair-share CPU scheduler): a job that was idle and bursts comes back at
    the level of the jobs that kept running, and from there the one that used less recently
    is served first. A job not seen before starts at 0, so with nobody active before it
    nothing changes. Pure: time comes in as ``now``; a ``now`` earlier than the last call's
    counts as no time passed."""

    __slots__ = ("active", "avg", "half_life_s", "last")

    def __init__(self, half_life_s: float) -> None:
        if not half_life_s > 0.0 or half_life_s == float("inf"):
            raise ValueError(
                f"share_half_life_s: expected a positive finite number, got {half_life_s}"
            )
        self.half_life_s = half_life_s
        self.last: float | None = None
        self.avg: dict[str, dict[str, float]] = {}
        self.active: set[str] = set()

    def update(
        self,
        now: float,
        held: Mapping[str, Mapping[str, int]],
        waiting: Iterable[str] = (),
        weights: Mapping[str, float] | None = None,
    ) -> dict[str, dict[str, float]]:
        last = self.last
        dt = 0.0 if last is None or now < last else now - last
        if last is None or now > last:
            self.last = now
        keep = 2.0 ** (-dt / self.half_life_s)
        avg = self.avg
        for name in held:
            if name not in avg:
                avg[name] = {}
        for name, got in avg.items():
            now_held = held.get(name, {})
            for r in now_held:
                if r not in got:
                    got[r] = 0.0
            for r, a in got.items():
                h = float(now_held.get(r, 0))
                got[r] = h + (a - h) * keep
        active: set[str] = set(waiting)
        for name, mine in held.items():
            for units in mine.values():
                if units > 0:
                    active.add(name)
                    break
        was = self.active
        stayed = [n for n in active if n in was]
        if stayed:
            w = weights if weights is not None else {}
            for name in active:
                if name in was:
                    continue
                back = avg.get(name)
                if back is None:
                    back = avg[name] = {}
                mine_w = w.get(name, 1.0)
                floor: dict[str, float] = {}
                for k in stayed:
                    ratio = mine_w / w.get(k, 1.0)
                    theirs = avg.get(k, {})
                    for r in set(theirs) | set(floor):
                        v = theirs.get(r, 0.0) * ratio
                        f = floor.get(r)
                        if f is None or v < f:
                            floor[r] = v
                for r, v in floor.items():
                    if back.get(r, 0.0) < v:
                        back[r] = v
        self.active = active
        return avg


@dataclass(slots=True)
class FairOrder:
    order: list[Action]  # the admitted actions, in the order to offer them
    capped: list[Action]  # waiting this pass: their job is at its cap
    never: list[tuple[Action, Shortfall]]  # minimum above the job's cap: can never run


def fair_order(
    waiting: Sequence[Action],
    jobs: Mapping[str, Job],
    held: Mapping[str, Mapping[str, int]],
    totals: Mapping[str, int],
    pools: Mapping[str, SchedPool] | None = None,
    affinity: Mapping[TrajectoryId, str] | None = None,
    usage: Mapping[str, Mapping[str, float]] | None = None,
) -> FairOrder | None:
    """The waiting actions in fair-share order (see the module doc); None: FCFS as is.

    ``totals`` empty: the units per resource are summed over ``pools``. With ``pools`` (and
    ``affinity``: trajectory -> pool id, where exec actions run), an action whose pool has
    no free units left for it this pass (counting the minimums of those offered before it)
    is not counted as held: each pool serves only its own queue, so counting it would hand
    the share it cannot take there to its job on another pool. Those come after the
    others, in the order they were reached.

    ``usage`` (decayed usage, ``DecayedUsage``): the shares start from it instead of from
    ``held`` (caps still count ``held``); None: the memoryless rule."""
    if not waiting:
        return None
    first = waiting[0].job
    single = True
    for a in waiting:
        if a.job != first:
            single = False
            break
    if single:
        spec = jobs.get(first)
        if spec is None or (spec.max_cores is None and spec.max_gpus is None):
            return None
    if not totals and pools is not None:
        totals = pool_totals(pools)
    per_job: dict[str, list[Action]] = {}
    names: list[str] = []
    for a in waiting:
        got = per_job.get(a.job)
        if got is None:
            per_job[a.job] = [a]
            names.append(a.job)
        else:
            got.append(a)
    order: list[Action] = []
    later: list[Action] = []  # reached when their pool had no units left: not counted
    capped: list[Action] = []
    never: list[tuple[Action, Shortfall]] = []
    free: dict[str, int] = {}
    if pools is not None:
        for pid, pool in pools.items():
            free[pid] = pool.free_units()
    where: Mapping[TrajectoryId, str] = affinity if affinity is not None else {}
    # per job: its spec, what it holds (copied: counted up as actions are offered), its
    # dominant share (unweighted), the next index into its queue
    specs: list[Job] = []
    usage_of: list[dict[str, int]] = []
    dom: list[float] = []
    lifts: list[dict[str, float]] = []  # per job: usage - held per resource (empty: none)
    nxt: list[int] = []
    heap: list[tuple[int, float, int, int]] = []  # (-priority, share, head seq, job index)
    for i, name in enumerate(names):
        spec = jobs.get(name)
        if spec is None:
            spec = Job(name)
        specs.append(spec)
        mine = dict(held.get(name, {}))
        usage_of.append(mine)
        lift: dict[str, float] = {}
        if usage is not None:
            past = usage.get(name, {})
            for r, u in past.items():
                lift[r] = u - mine.get(r, 0)
            for r, units in mine.items():
                if r not in past:
                    lift[r] = -float(units)
            d = _dominant_f(past, totals)
        else:
            d = dominant_share(mine, totals)
        lifts.append(lift)
        dom.append(d)
        nxt.append(0)
        heap.append((-spec.priority, d / spec.weight, per_job[name][0].seq, i))
    heapq.heapify(heap)
    while heap:
        if len(heap) == 1:  # one job left: the rest of its queue in order (caps still apply)
            _, _, _, i = heap[0]
            heap.clear()
            _drain(per_job[names[i]], nxt[i], specs[i], usage_of[i], order, capped, never)
            break
        prio, _, _, i = heapq.heappop(heap)
        queue = per_job[names[i]]
        k = nxt[i]
        spec = specs[i]
        weight = spec.weight
        capless = spec.max_cores is None and spec.max_gpus is None
        mine = usage_of[i]
        off = lifts[i]
        d = dom[i]
        nq = len(queue)
        # the job's actions while it stays the furthest below its share (the heap's top is
        # the next job's key): one heap operation per run of actions, not per action
        top_prio, top_share, top_seq, top_i = heap[0]
        while k < nq:
            a = queue[k]
            kind = a.kind  # resource(a), inlined (compiled: no call through a Callable)
            r = "cpu" if kind == "exec" else "gpu" if kind == "service" else a.key
            need = a.min_units
            have = mine.get(r, 0)
            if not capless:
                cap = spec.cap(r)
                if cap is not None and have + need > cap:
                    if need > cap:
                        never.append((a, _over_cap(a, r, need, cap, spec.name)))
                        k += 1
                        continue
                    capped.extend(queue[k:])  # FCFS within the job: the rest waits
                    k = nq
                    break
            if free:
                at = where.get(a.trajectory) if kind == "exec" else r
                left = free.get(at, -1) if at is not None else -1
                if at is not None and left >= 0:  # on a known pool: it takes units there
                    if left < need:
                        later.append(a)  # not counted: its share goes to others this pass
                        k += 1
                        continue
                    free[at] = left - need
            order.append(a)
            have += need
            mine[r] = have
            total = totals.get(r, 0)
            if total > 0:
                f = (have + off.get(r, 0.0)) / total if off else have / total
                if f > d:
                    d = f
            k += 1
            if k < nq and prio == top_prio:  # (a higher priority than the top: keeps going)
                share = d / weight
                if share > top_share or (
                    share == top_share
                    and (queue[k].seq > top_seq or (queue[k].seq == top_seq and i > top_i))
                ):
                    break
        dom[i] = d
        nxt[i] = k
        if k < nq:
            heapq.heappush(heap, (prio, d / weight, queue[k].seq, i))
    order.extend(later)
    return FairOrder(order, capped, never)


def _dominant_f(usage: Mapping[str, float], totals: Mapping[str, int]) -> float:
    """max over resources of usage / total (0 where nothing was used): unweighted."""
    best = 0.0
    for r, units in usage.items():
        total = totals.get(r, 0)
        if total > 0 and units > 0.0:
            f = units / total
            if f > best:
                best = f
    return best


def _drain(
    queue: list[Action],
    k: int,
    spec: Job,
    mine: dict[str, int],
    order: list[Action],
    capped: list[Action],
    never: list[tuple[Action, Shortfall]],
) -> None:
    if spec.max_cores is None and spec.max_gpus is None:
        order.extend(queue[k:])
        return
    for j in range(k, len(queue)):
        a = queue[j]
        r = resource_of(a)
        need = a.min_units
        cap = spec.cap(r)
        have = mine.get(r, 0)
        if cap is not None and have + need > cap:
            if need > cap:
                never.append((a, _over_cap(a, r, need, cap, spec.name)))
                continue
            capped.extend(queue[j:])
            return
        mine[r] = have + need
        order.append(a)


def _over_cap(a: Action, r: str, need: int, cap: int, job: str) -> Shortfall:
    key = "max_cores" if r == "cpu" else "max_gpus"
    return Shortfall(r, need, 0, cap, f"job {job!r} has {key} = {cap}, the action needs {need}")
