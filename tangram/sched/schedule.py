"""The elastic scheduler (design §4, paper §4.2 Alg. 1–2): one pure scheduling pass.

Contract
--------
``schedule(snapshot, now, config) -> Decision`` reads the waiting queue (FCFS order), the
pools and the running actions' expected finish times, and returns which actions to place
(pool, amount, concrete units), which wait, and which can never run here (with a
``Shortfall``). Inputs are read-only: pools are only *asked* (``operator``, ``pick_units``,
``extra_cost``); the driver applies the placements. No I/O, no clock (``now`` is an
argument), no randomness: the same snapshot gives the same decision.

Algorithm, per pool (one CPU pool per node, one GPU pool, one pool per API endpoint)
----------------------------------------------------------------------------------
1. Candidates: the longest FCFS prefix of the pool's queue whose *minimum* key amounts fit
   the pool's free units jointly and topology-aware (through the pool's DP operator).
   ``order="backfill"`` (our improvement, selectable) lets later actions that fit start past
   a blocked one unless the blocked one has waited ``starvation_s`` (then strict FCFS
   resumes, so no action is overtaken forever).
2. Non-elastic candidates are placed at their minimum; elastic ones share the rest.
3. Greedy eviction over one DP table (row ``t`` = optimal split among the first ``t``
   elastic candidates): start with all, evict the last while the objective drops.
4. Objective (Alg. 2): exact ACTs of the placed candidates + an FCFS replay of the waiting
   queue against the completion heap, each waiting action at its minimum as soon as it fits;
   the first ``depth - 1`` replayed actions try each allowed amount instead.
5. Cache awareness: a service action's duration includes the pool's restore cost where the
   service is not resident (``SchedPool.extra_cost``).

Trajectories without a node yet (first exec action) are given the memory-balanced node
with room; one that has waited ``starvation_s`` is pinned to a node and queued there in
FCFS order, so it cannot be starved by other trajectories' actions.

Complexity
----------
Per pool with ``q`` queued actions, ``n`` elastic candidates, ``R`` free units, allowed-set
size ``|s|``: candidates ``O(q)``, DP ``O(n·R·|s|)`` vectorised, each objective evaluation
``O(W log W + |s|·W)`` with the replay window ``W = min(q, replay_limit)``, and the eviction
loop evaluates the objective until it stops improving (usually 1–3 times).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from tangram.model import Action, ActionId, Shortfall, TrajectoryId
from tangram.sched.dp import DPTable
from tangram.sched.operators import BaseOperator, Operator
from tangram.sched.pool import SchedPool

Order = Literal["fcfs", "backfill"]
ORDERS: tuple[str, ...] = ("fcfs", "backfill")
Rule = Literal["paper", "wait", "wait-eft"]
RULES: tuple[str, ...] = ("paper", "wait", "wait-eft")
_NEVER = 1e9  # replay penalty (seconds) for an action that cannot start at all


@dataclass(frozen=True, slots=True)
class SchedConfig:
    depth: int = 2
    order: Order = "fcfs"
    starvation_s: float = 30.0
    replay_limit: int = 512
    max_branch: int = 4  # amounts tried per depth level in the replay (spread over the set)
    # "paper": the depth branch tries the amounts that fit when the action can first start,
    # and eviction stops at one candidate (Alg. 1-2 as read from the paper).
    # "wait" (ours): the branch may also wait for more units (each amount starts when that
    # many are free), and eviction may go down to zero candidates, so an elastic action
    # can prefer 4 cores in 1 s over 1 core now.
    # "wait-eft" (ours, default): "wait", and on plain unit-count pools (CPU nodes)
    # every later replayed elastic action (past the depth branch) starts at the amount with
    # the earliest expected finish given the completion heap, instead of at its minimum as
    # soon as that fits, so the replay does not price the queue behind a deferred action
    # as stragglers on 1 unit. Other pools replay as under "wait".
    rule: Rule = "wait-eft"

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")
        if self.order not in ORDERS:
            raise ValueError(f"order {self.order!r} not in {ORDERS}")
        if self.rule not in RULES:
            raise ValueError(f"rule {self.rule!r} not in {RULES}")
        if self.replay_limit < 1 or self.max_branch < 1:
            raise ValueError("replay_limit and max_branch must be >= 1")


class MemoryView(Protocol):
    """What node choice needs from a CPU node pool."""

    pool_id: str

    @property
    def mem_free(self) -> int: ...

    @property
    def mem_reserved(self) -> int: ...

    def free_units(self) -> int: ...

    def never_fits(self, action: Action) -> Shortfall | None: ...


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Read-only view of everything one pass needs."""

    waiting: Sequence[Action]  # FCFS order (ascending seq)
    pools: Mapping[str, SchedPool]
    affinity: Mapping[TrajectoryId, str] = field(default_factory=dict)  # trajectory -> pool_id
    running: Mapping[str, Sequence[tuple[float, int]]] = field(default_factory=dict)
    estimate: Callable[[str], float] = lambda klass: 1.0
    env_mem: Callable[[Action], int] = lambda action: 0  # memory to reserve on first action


@dataclass(frozen=True, slots=True)
class Placement:
    action_id: ActionId
    pool_id: str
    amount: int
    units: tuple[int, ...]
    expected_s: float
    new_node: bool = False  # first action of its trajectory: the driver records affinity


@dataclass(frozen=True, slots=True)
class Infeasible:
    action_id: ActionId
    shortfall: Shortfall


@dataclass(frozen=True, slots=True)
class Decision:
    placements: tuple[Placement, ...]
    waiting: tuple[ActionId, ...]
    infeasible: tuple[Infeasible, ...]
    # Alg. 2 estimate of the sum of future ACTs (seconds from now) of the chosen placement,
    # summed over the pools where greedy eviction had a choice (>= 2 elastic candidates)
    objective: float
    evicted: int  # elastic candidates sent back to the queue by greedy eviction

    def placed_ids(self) -> set[ActionId]:
        return {p.action_id for p in self.placements}


def pool_of(action: Action, affinity: Mapping[TrajectoryId, str]) -> str | None:
    """The pool an action's key resource lives in (None: exec action without a node yet)."""
    if action.kind == "exec":
        return affinity.get(action.trajectory)
    if action.kind == "service":
        return "gpu"
    return action.key


def schedule(snapshot: Snapshot, now: float, config: SchedConfig | None = None) -> Decision:
    cfg = config or SchedConfig()
    infeasible: list[Infeasible] = []
    queues: dict[str, list[Action]] = {}
    new_nodes: set[ActionId] = set()
    unplaced_new: list[Action] = []
    never_memo: dict[tuple[Any, ...], Shortfall | None] = {}
    for action in snapshot.waiting:
        pid = pool_of(action, snapshot.affinity)
        if pid is None:
            unplaced_new.append(action)
            continue
        pool = snapshot.pools.get(pid)
        if pool is None:
            infeasible.append(Infeasible(action.id, _no_pool(action, pid)))
            continue
        # never_fits depends only on these fields; memoised because queues are long
        sig = (pid, action.kind, action.service, action.min_units, action.demand.get("mem"))
        if sig in never_memo:
            short = never_memo[sig]
        else:
            short = never_memo[sig] = pool.never_fits(action)
        if short is not None:
            infeasible.append(Infeasible(action.id, short))
            continue
        queues.setdefault(pid, []).append(action)
    if unplaced_new:
        assigned, never = _assign_nodes(unplaced_new, snapshot, now, cfg)
        infeasible.extend(never)
        for action, pid in assigned:
            queues.setdefault(pid, []).append(action)
            new_nodes.add(action.id)
        for pid in {pid for _, pid in assigned}:
            queues[pid].sort(key=lambda a: a.seq)

    placements: list[Placement] = []
    objective = 0.0
    evicted = 0
    for pid in sorted(queues):
        pool = snapshot.pools[pid]
        result = _schedule_pool(pool, queues[pid], snapshot, now, cfg)
        objective += result.objective
        evicted += result.evicted
        if not result.placed:
            continue
        units = pool.pick_units(result.placed)
        for (action, amount), unit_ids, dur in zip(result.placed, units, result.durs, strict=True):
            placements.append(
                Placement(action.id, pid, amount, unit_ids, dur, action.id in new_nodes)
            )
    placed = {p.action_id for p in placements}
    bad = {i.action_id for i in infeasible}
    waiting = tuple(a.id for a in snapshot.waiting if a.id not in placed and a.id not in bad)
    return Decision(tuple(placements), waiting, tuple(infeasible), objective, evicted)


def _no_pool(action: Action, pid: str) -> Shortfall:
    requested = action.min_units
    what = action.service or action.api or pid
    return Shortfall(action.key, requested, 0, 0, f"no pool {pid!r} serves {what!r}")


# ----------------------------------------------------------------------------- node choice


def _assign_nodes(
    actions: Sequence[Action], snap: Snapshot, now: float, cfg: SchedConfig
) -> tuple[list[tuple[Action, str]], list[Infeasible]]:
    """Memory-balanced node for each trajectory's first action (design §5.2 placement)."""
    nodes: list[Any] = [p for pid, p in sorted(snap.pools.items()) if pid.startswith("cpu:")]
    mem_free = {p.pool_id: p.mem_free for p in nodes}
    mem_used = {p.pool_id: p.mem_reserved for p in nodes}
    cores_free = {p.pool_id: p.free_units() for p in nodes}
    assigned: list[tuple[Action, str]] = []
    never: list[Infeasible] = []
    memo: dict[tuple[Any, ...], list[Any]] = {}
    most_free = max(cores_free.values(), default=0)
    for action in actions:
        starving = now - action.submitted_at >= cfg.starvation_s
        if action.min_units > most_free and not starving:
            continue  # no node has the cores now: it waits (cheap exit for long queues)
        need_mem = snap.env_mem(action)
        sig = (action.min_units, action.demand.get("mem"), need_mem)
        fits_ever = memo.get(sig)
        if fits_ever is None:
            fits_ever = memo[sig] = [
                p
                for p in nodes
                if p.never_fits(action) is None
                and need_mem <= mem_free[p.pool_id] + mem_used[p.pool_id]
            ]
        if not fits_ever:
            cap = max((p.capacity for p in nodes), default=0)
            reason = (
                "no CPU nodes"
                if not nodes
                else f"needs {action.min_units} cores and "
                f"{need_mem} bytes of memory on one node; largest node has {cap} cores"
            )
            never.append(Infeasible(action.id, Shortfall("cpu", action.min_units, 0, cap, reason)))
            continue
        room = [
            p
            for p in fits_ever
            if mem_free[p.pool_id] >= need_mem and cores_free[p.pool_id] >= action.min_units
        ]
        if not room and not starving:
            continue  # waits; no node has room now
        pick = min(room or fits_ever, key=lambda p: (_mem_load(p, mem_free, mem_used), p.pool_id))
        pid = pick.pool_id
        if mem_free[pid] >= need_mem:
            mem_free[pid] -= need_mem
            mem_used[pid] += need_mem
            cores_free[pid] = max(0, cores_free[pid] - action.min_units)
            most_free = max(cores_free.values())
            assigned.append((action, pid))
        elif starving:
            # pinned but memory not free yet: queue it there so it blocks later work (FCFS)
            assigned.append((action, pid))
    return assigned, never


def _mem_load(pool: Any, free: Mapping[str, int], used: Mapping[str, int]) -> float:
    total = free[pool.pool_id] + used[pool.pool_id]
    return used[pool.pool_id] / total if total else 1.0


# ----------------------------------------------------------------------------- one pool


@dataclass(slots=True)
class _PoolResult:
    placed: list[tuple[Action, int]]
    durs: list[float]
    objective: float
    evicted: int


class _Durations:
    """Per-pass cache of durations (history estimate + pool extra cost)."""

    __slots__ = ("_cache", "_estimate", "_extra", "_pool", "at_min")

    def __init__(self, pool: SchedPool, estimate: Callable[[str], float]) -> None:
        self._pool = pool
        self._estimate = estimate
        self._cache: dict[tuple[ActionId, int], float] = {}
        self.at_min: dict[ActionId, float] = {}  # duration at the minimum, by action id
        # extra_cost depends only on (kind, service, amount) within one pass (SchedPool doc)
        self._extra: dict[tuple[str, str | None, int], float] = {}

    def table(self, action: Action, amounts: tuple[int, ...]) -> dict[int, float]:
        """Durations at each of ``amounts`` (the DP's choices for one candidate)."""
        prof = action.profiled
        out: dict[int, float] = {}
        for u in amounts:
            base = prof.get(u)
            if base is None:
                out[u] = self(action, u)
                continue
            extra_key = (action.kind, action.service, u)
            extra = self._extra.get(extra_key)
            if extra is None:
                extra = self._extra[extra_key] = self._pool.extra_cost(action, u)
            out[u] = base + extra
        return out

    def minimum(self, action: Action) -> float:
        d = self.at_min.get(action.id)
        if d is None:
            d = self.at_min[action.id] = self(action, action.min_units)
        return d

    def __call__(self, action: Action, amount: int) -> float:
        key = (action.id, amount)
        dur = self._cache.get(key)
        if dur is None:
            base = action.duration(amount, self._estimate(action.klass))
            extra_key = (action.kind, action.service, amount)
            extra = self._extra.get(extra_key)
            if extra is None:
                extra = self._extra[extra_key] = self._pool.extra_cost(action, amount)
            dur = base + extra
            self._cache[key] = dur
        return dur


def _elastic_amounts(action: Action, max_single: int) -> tuple[int, ...]:
    return tuple(a for a in action.allowed if a <= max_single)


def _schedule_pool(
    pool: SchedPool, queue: Sequence[Action], snap: Snapshot, now: float, cfg: SchedConfig
) -> _PoolResult:
    op = pool.operator()
    dur = _Durations(pool, snap.estimate)
    cands, rest = _candidates(op, queue, now, cfg)
    if not cands:
        return _PoolResult([], [], 0.0, 0)
    max_single = pool.max_single()
    fixed: list[Action] = []
    elastic: list[Action] = []
    for a in cands:
        if a.elastic and len(_elastic_amounts(a, max_single)) > 1:
            elastic.append(a)
        else:
            fixed.append(a)
    state = op.start()
    for a in fixed:
        nxt = op.take(state, a.min_units)
        assert nxt is not None  # the candidate prefix fit at minimum
        state = nxt
    choices = [dur.table(a, _elastic_amounts(a, max_single)) for a in elastic]
    table = DPTable(choices, op, start=state)
    n = len(elastic)
    while n > 0 and not table.feasible(n):  # chunk order effects: drop trailing candidates
        rest.append(elastic.pop())
        n -= 1
    rest.sort(key=lambda a: a.seq)
    # The replay window is a fixed set for every t (evicted candidates + the first
    # ``replay_limit`` non-candidates), so objective values of different t compare.
    window = rest[: cfg.replay_limit]
    running = [(max(f - now, 0.0), u) for f, u in snap.running.get(pool.pool_id, ())]
    fixed_heap = [(dur(a, a.min_units), a.min_units) for a in fixed]
    fixed_total = sum(d for d, _ in fixed_heap)
    base_heap = running + fixed_heap
    replay = _Replay(op, dur, cfg, max_single)

    base_heap.sort()  # a sorted list is a valid heap: copied, never re-heapified
    rank = {a.id: k for k, a in enumerate(elastic)}
    merged = list(heapq.merge(elastic, window, key=lambda a: a.seq))

    def objective(t: int) -> tuple[float, list[int]]:
        arr = table.row(t)
        heap = list(base_heap)
        s = state
        for k, amount in enumerate(arr.amounts):
            nxt = op.take(s, amount)
            assert nxt is not None
            s = nxt
            heapq.heappush(heap, (choices[k][amount], amount))
        waiting = [a for a in merged if rank.get(a.id, n) >= t]
        return fixed_total + arr.total + replay.run(waiting, s, heap), arr.amounts

    lowest_t = 1 if cfg.rule == "paper" else 0
    if n <= lowest_t:
        # Nothing to evict: the placement is fixed, so the objective is not evaluated (it
        # only serves to compare eviction steps); its value is reported as 0 for this pool.
        best_t, best = n, 0.0
        best_amounts = table.row(n).amounts if n else list[int]()
    else:
        best_t = n
        best, best_amounts = objective(n)
    t = n - 1
    while t >= lowest_t:
        value, amounts = objective(t)
        if value >= best:
            break
        best_t, best, best_amounts = t, value, amounts
        t -= 1
    placed: list[tuple[Action, int]] = []
    chosen = dict(zip((a.id for a in elastic[:best_t]), best_amounts, strict=True))
    fixed_ids = {a.id for a in fixed}
    for a in cands:
        if a.id in chosen:
            placed.append((a, chosen[a.id]))
        elif a.id in fixed_ids:
            placed.append((a, a.min_units))
    durs = [dur(a, amount) for a, amount in placed]
    return _PoolResult(placed, durs, best, n - best_t)


def _candidates(
    op: Operator[Any], queue: Sequence[Action], now: float, cfg: SchedConfig
) -> tuple[list[Action], list[Action]]:
    """FCFS prefix whose minimums fit jointly (or backfill up to the starvation bound)."""
    state = op.start()
    free = op.units(state)
    cands: list[Action] = []
    rest: list[Action] = []
    take = op.take
    fcfs = cfg.order == "fcfs"
    for i, a in enumerate(queue):
        if free == 0:
            rest.extend(queue[i:])
            break
        nxt = take(state, a.min_units)
        if nxt is None:
            rest.append(a)
            if fcfs or now - a.submitted_at >= cfg.starvation_s:
                rest.extend(queue[i + 1 :])
                break
            continue
        state = nxt
        free = op.units(state)
        cands.append(a)
    return cands, rest


def _eft_amount(
    opts: list[tuple[int, float]],
    free: int,
    order: list[tuple[float, int]],
    head: int,
    clock: float,
) -> tuple[int, float]:
    """(amount, duration) of ``opts`` (ascending amounts) with the earliest finish, given
    ``free`` units now and expected finishes ``order[head:]`` (ascending)."""
    best, pick = _NEVER, opts[0]
    if free >= opts[-1][0]:  # all start now: the shortest duration wins
        for opt in opts:
            if opt[1] < best:
                best, pick = opt[1], opt
        return pick
    s, clk, j, n = free, clock, head, len(order)
    for opt in opts:
        amount = opt[0]
        while s < amount and j < n:
            finish, units = order[j]
            j += 1
            if finish > clk:
                clk = finish
            s += units
        if s < amount:
            break
        fin = clk + opt[1]
        if fin < best:
            best, pick = fin, opt
    return pick


def _spread(values: tuple[int, ...], k: int) -> tuple[int, ...]:
    """At most k values spread over a sorted tuple, always keeping both ends."""
    if len(values) <= k:
        return values
    step = (len(values) - 1) / (k - 1)
    return tuple(sorted({values[round(i * step)] for i in range(k)}))


class _Replay:
    """Alg. 2: estimated sum of ACTs (relative to now) of a waiting list replayed FCFS.

    Each waiting action starts at its minimum as soon as it fits, popping expected finishes
    from the completion heap. The first ``depth - 1`` replayed elastic actions try each
    allowed amount (at most ``max_branch`` of them, spread over the set); each option is
    judged on a bounded look-ahead of ``branch_window`` actions, then the best one is
    replayed to the end. The base operator (plain unit counts) has an inlined fast path.
    """

    branch_window = 16

    def __init__(self, op: Operator[Any], dur: _Durations, cfg: SchedConfig, max_single: int):
        self.op = op
        self.dur = dur
        self.cfg = cfg
        self.max_single = max_single
        self.fast = isinstance(op, BaseOperator)
        # EFT replay on plain unit counts only (CPU nodes): on GPU chunk pools it was
        # measured worse than "wait" (MOPD+Search teacher ACT +7%, DeepSearch judge +18%)
        self.eft = cfg.rule == "wait-eft" and self.fast
        self._options: dict[ActionId, list[tuple[int, float]]] = {}

    def run(self, waiting: Sequence[Action], state: Any, heap: list[tuple[float, int]]) -> float:
        return self._run(waiting, 0, len(waiting), state, heap, 0.0, self.cfg.depth)

    def _run(
        self,
        waiting: Sequence[Action],
        i: int,
        end: int,
        state: Any,
        heap: list[tuple[float, int]],
        clock: float,
        depth: int,
    ) -> float:
        if depth <= 1:  # no branching left: the specialised replays
            if self.eft:
                return self._eft(waiting, i, end, state, heap, clock)
            if self.fast:
                return self._plain_fast(waiting, i, end, state, heap, clock)
        total = 0.0
        dur = self.dur
        while i < end:
            w = waiting[i]
            state, clock, ok = self._wait_for(state, heap, clock, w.min_units)
            if not ok:
                return total + _NEVER * (end - i)
            if depth > 1 and w.elastic:
                return total + self._branch(waiting, i, end, state, heap, clock, depth)
            d = dur.minimum(w)
            total += clock + d
            heapq.heappush(heap, (clock + d, w.min_units))
            state = self.op.take(state, w.min_units)
            i += 1
        return total

    def _plain_fast(
        self,
        waiting: Sequence[Action],
        i: int,
        end: int,
        free: int,
        heap: list[tuple[float, int]],
        clock: float,
    ) -> float:
        total = 0.0
        at_min = self.dur.at_min
        minimum = self.dur.minimum
        pop, push = heapq.heappop, heapq.heappush
        while i < end:
            w = waiting[i]
            need = w.min_units
            while free < need:
                if not heap:
                    return total + _NEVER * (end - i)
                finish, units = pop(heap)
                if finish > clock:
                    clock = finish
                free += units
            d = at_min.get(w.id)
            if d is None:
                d = minimum(w)
            total += clock + d
            push(heap, (clock + d, need))
            free -= need
            i += 1
        return total

    def _eft(
        self,
        waiting: Sequence[Action],
        i: int,
        end: int,
        free: int,
        heap: list[tuple[float, int]],
        clock: float,
    ) -> float:
        """FCFS replay where each elastic action takes its earliest-finishing amount.

        An amount ``u`` can start once ``u`` units are free (taking expected finishes in
        order); among the (spread) allowed amounts the one with the smallest start + duration
        wins, ties to the smaller amount. Non-elastic actions start at their minimum. Runs on
        plain unit counts only (``free`` is the number of free units). The completion heap is
        kept as a sorted list with a moving head, so each elastic action's look-up scans it
        in order without re-sorting.
        """
        total = 0.0
        at_min, minimum = self.dur.at_min, self.dur.minimum
        order = sorted(heap)
        head, size, insort = 0, len(order), bisect.insort
        for k in range(i, end):
            w = waiting[k]
            u = w.min_units
            d = -1.0
            if w.elastic:
                opts = self._option_durs(w)
                if len(opts) > 1:
                    u, d = _eft_amount(opts, free, order, head, clock)
            while free < u:
                if head == size:
                    return total + _NEVER * (end - k)
                finish, units = order[head]
                head += 1
                if finish > clock:
                    clock = finish
                free += units
            if d < 0.0:
                d = at_min.get(w.id) or minimum(w)
            total += clock + d
            insort(order, (clock + d, u), lo=head)  # finishes never precede the clock
            size += 1
            free -= u
        return total

    def _option_durs(self, w: Action) -> list[tuple[int, float]]:
        """(amount, duration) for the spread of w's allowed amounts, cached per pass."""
        opts = self._options.get(w.id)
        if opts is None:
            amounts = _spread(_elastic_amounts(w, self.max_single), self.cfg.max_branch)
            opts = self._options[w.id] = [(u, self.dur(w, u)) for u in amounts]
        return opts

    def _wait_for(
        self, state: Any, heap: list[tuple[float, int]], clock: float, need: int
    ) -> tuple[Any, float, bool]:
        if self.fast:  # plain unit counts
            while state < need:
                if not heap:
                    return state, clock, False
                finish, units = heapq.heappop(heap)
                if finish > clock:
                    clock = finish
                state += units
            return state, clock, True
        take, give = self.op.take, self.op.give
        while take(state, need) is None:
            if not heap:
                return state, clock, False
            finish, units = heapq.heappop(heap)
            if finish > clock:
                clock = finish
            state = give(state, units)
        return state, clock, True

    def _branch(
        self,
        waiting: Sequence[Action],
        i: int,
        end: int,
        state: Any,
        heap: list[tuple[float, int]],
        clock: float,
        depth: int,
    ) -> float:
        w = waiting[i]
        take = self.op.take
        amounts = _spread(_elastic_amounts(w, self.max_single), self.cfg.max_branch)
        if self.cfg.rule == "paper":
            options = [u for u in amounts if take(state, u) is not None]
        else:
            options = list(amounts)
        look = min(end, i + 1 + self.branch_window)

        def cost(u: int, stop: int) -> float:
            h = list(heap)
            s, clk, ok = self._wait_for(state, h, clock, u)  # "wait": start when u are free
            if not ok:
                return _NEVER
            d = self.dur(w, u)
            heapq.heappush(h, (clk + d, u))
            rest = self._run(waiting, i + 1, stop, take(s, u), h, clk, depth - 1)
            return clk + d + rest

        if len(options) == 1:
            return cost(options[0], end)
        costs = {u: cost(u, look) for u in options}
        best_u = min(options, key=costs.__getitem__)
        # the look-ahead already covered the whole window when it is short: reuse it
        return cost(best_u, end) if look < end else costs[best_u]
