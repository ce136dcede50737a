"""The elastic scheduler (docs/design.md §4, paper §4.2 Alg. 1–2): one pure scheduling pass.

Contract
--------
``schedule(snapshot, now, config) -> Decision`` reads the waiting queue (FCFS order), the
pools and the running actions' expected finish times, and returns which actions to place
(pool, amount, concrete units), which wait, and which can never run here (with a
``Shortfall``). Inputs are read-only: pools are only *asked* (``operator``, ``pick_units``,
``extra_cost``); the driver applies the placements. No I/O, no clock (``now`` is an
argument), no randomness: the same snapshot gives the same decision.

Jobs (issue 34): when the waiting actions belong to several jobs (or one with a cap), the
queue is first put in fair-share order (``tangram.sched.share``: strict priority, then
weighted dominant-resource fairness over what each job holds, FCFS within a job; a job at
its cap waits) and every pool below serves its queue in that order instead of FCFS. With one
job the pass does not look at jobs at all.

Joint admission (issue 34): an action with ``extra`` units on other pools (an exec's
cores + one slot of an API, ``Action.extra``) is offered to its key pool only while every
extra pool has those units left in this pass; what its key pool places gets them, on the
same ``Placement`` (``also``), so the driver reserves all of its units together or none.
Key pools other than APIs are served first, then the API pools with what the extras left.
An extra pool that does not exist, or can never hold the amount, makes it infeasible. With
no such action in the queue the pass is the one below, unchanged.

Algorithm, per pool (one CPU pool per node, one GPU pool, one pool per API endpoint)
----------------------------------------------------------------------------------
0. Prices (rule ``priced``, the default, on plain unit-count pools = CPU nodes): each queued
   elastic action's allowed set is narrowed to the band ``[k*/2, k*]`` around its DoP priced
   by the pool's load (``tangram.sched.price``; the load comes from ``Snapshot.load``).
   Everything below then works on the banded sets.
1. Candidates: the longest FCFS prefix of the pool's queue whose *lowest* key amounts fit
   the pool's free units jointly and topology-aware (through the pool's DP operator).
   ``order="backfill"`` (our improvement, selectable) lets later actions that fit start past
   a blocked one unless the blocked one has waited ``starvation_s`` (then strict FCFS
   resumes, so no action is overtaken forever). Under ``priced`` with FCFS order, short
   non-elastic actions backfill EASY-style: past the first blocked action only when they
   do not delay its reservation.
2. Non-elastic candidates are placed at their minimum; elastic ones share the rest.
3. Greedy eviction over one DP table (row ``t`` = optimal split among the first ``t``
   elastic candidates): start with all, evict the last while the objective drops.
4. Objective (Alg. 2, ``tangram.sched.replay``): exact ACTs of the placed candidates + an
   FCFS replay of the waiting queue against the completion heap; the first ``depth - 1``
   replayed elastic actions try each amount, later ones start at their lowest amount
   ("paper", "wait") or at their earliest-finishing one ("wait-eft", "priced").
5. Cache awareness: a service action's duration includes the pool's restore cost where the
   service is not resident (``SchedPool.extra_cost``).

Trajectories without a node yet (first exec action) are given the memory-balanced node
with room; one that has waited ``starvation_s`` is pinned to the least-loaded node with its
memory free even without free cores, and queued there in FCFS order, so it cannot be
starved by other trajectories' actions. Where no node has its memory free it waits
node-less (never queued on a node the driver could not reserve its memory on), first in
line for the memory that frees.

Complexity
----------
Per pool with ``q`` queued actions, ``n`` elastic candidates, ``R`` free units, allowed-set
size ``|s|``: prices ``O(q)``, candidates ``O(q)`` (EASY: ``O(q + r log r)`` for ``r``
running actions), DP ``O(n·R·|s|)`` vectorised, each objective evaluation
``O(W log W + |s|·W)`` with the replay window ``W = min(q, replay_limit)``, and the eviction
loop evaluates the objective until it stops improving (usually 1–3 times).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter
from typing import Any, Literal, NamedTuple

from tangram.model import Action, ActionId, Shortfall, TrajectoryId
from tangram.sched.dp import DPTable
from tangram.sched.load import PoolLoad
from tangram.sched.operators import BaseOperator, Operator
from tangram.sched.pool import SchedPool
from tangram.sched.price import NO_LOAD, price_bands
from tangram.sched.replay import Durations, Replay, _bisect_left, _insort, elastic_amounts
from tangram.sched.share import Job, fair_order

Order = Literal["fcfs", "backfill"]
ORDERS: tuple[str, ...] = ("fcfs", "backfill")
Rule = Literal["paper", "wait", "wait-eft", "priced"]
RULES: tuple[str, ...] = ("paper", "wait", "wait-eft", "priced")
_SEQ = attrgetter("seq")  # FCFS sort key (a C-level getter: queues are sorted every pass)
_UNKNOWN: Any = object()  # memo miss marker (None is a memoised "fits")


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
    # "wait-eft" (ours): "wait", and on plain unit-count pools (CPU nodes)
    # every later replayed elastic action (past the depth branch) starts at the amount with
    # the earliest expected finish given the completion heap, instead of at its minimum as
    # soon as that fits, so the replay does not price the queue behind a deferred action
    # as stragglers on 1 unit. Other pools replay as under "wait".
    # "priced" (ours, default): "wait-eft", and on plain unit-count pools each elastic
    # action may only take amounts in [k*/2, k*], k* its DoP priced by the pool's load
    # (tangram.sched.price), and elastic actions leave a reserve for short calls.
    rule: Rule = "priced"
    # report Decision.quiet (a driver that leaves quiet nodes out asks: the simulator; the
    # daemon does not, and its passes do not pay for the bookkeeping)
    quiet: bool = False
    # fair share across jobs (tangram.sched.share): 0, the share counts the units each job
    # holds now (memoryless); H > 0, an exponentially decayed average of the units it held,
    # half-life H seconds (the drivers keep it with DecayedUsage and pass it as
    # Snapshot.usage)
    share_half_life_s: float = 0.0

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")
        if self.order not in ORDERS:
            raise ValueError(f"order {self.order!r} not in {ORDERS}")
        if self.rule not in RULES:
            raise ValueError(f"rule {self.rule!r} not in {RULES}")
        if self.replay_limit < 1 or self.max_branch < 1:
            raise ValueError("replay_limit and max_branch must be >= 1")
        h = self.share_half_life_s
        if not h >= 0.0 or h == float("inf"):
            raise ValueError(f"share_half_life_s must be a finite number >= 0, got {h}")


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Read-only view of everything one pass needs."""

    waiting: Sequence[Action]  # FCFS order (ascending seq)
    pools: Mapping[str, SchedPool]
    affinity: Mapping[TrajectoryId, str] = field(default_factory=dict)  # trajectory -> pool_id
    running: Mapping[str, Sequence[tuple[float, int]]] = field(default_factory=dict)
    estimate: Callable[[str], float] = lambda klass: 1.0
    env_mem: Callable[[Action], int] = lambda action: 0  # memory to reserve on first action
    # recent offered load per pool (LoadMeter), read by the "priced" rule; none: no forecast
    load: Mapping[str, PoolLoad] = field(default_factory=dict)
    # jobs (tangram.sched.share): their terms (a job not named: weight 1, priority 0, no cap),
    # the units each job's running actions hold (job -> resource -> units) and the cluster's
    # units per resource (empty: summed over ``pools``). Waiting actions of one job with no
    # cap: the pass does not read them (the single-job pass, unchanged).
    jobs: Mapping[str, Job] = field(default_factory=dict)
    held: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    totals: Mapping[str, int] = field(default_factory=dict)
    # decayed usage (share_half_life_s > 0: tangram.sched.share.DecayedUsage, job ->
    # resource -> units averaged over the recent past): the shares count it instead of
    # ``held``; None: the memoryless share
    usage: Mapping[str, Mapping[str, float]] | None = None


class Placement(NamedTuple):
    """One action to start: on which pool, at which amount, on which units.

    A named tuple, not a frozen dataclass: a pass builds one per started action (530 in a
    (4096, 1024) pass), and a frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__`` (what that cost: docs/results.md, ``bench/sched.py``). Immutable,
    hashable and with the same ``repr`` either way; unlike the dataclass it also compares
    equal to a plain tuple of its fields (no caller compares placements)."""

    action_id: ActionId
    pool_id: str
    amount: int
    units: tuple[int, ...]
    expected_s: float
    new_node: bool = False  # first action of its trajectory: the driver records affinity
    # its units on other pools (joint admission): (pool id, units), reserved with these
    also: tuple[tuple[str, tuple[int, ...]], ...] = ()


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
    # the nodes given this pass to trajectories' first actions (action, pool id), placed
    # or queued there (a driver that passes only some node-less actions checks with it
    # that the memory left could not have gone to those it left out: tangram.sim.engine)
    assigned: tuple[tuple[ActionId, str], ...] = ()
    # (with SchedConfig.quiet) the CPU nodes whose queue had no candidate this pass (nothing
    # could start), each with
    # the time before which, with its queue, units, running actions and load unchanged, a
    # pass would find none either (the starvation bound, the bypass of actions that have
    # waited their run time and the next expected finish move with the clock alone), and
    # what it read of the history estimates: (class, e, s) holds while the class's
    # estimate d has d > e and, with s finite, the clock t has t < s + d. A driver may
    # leave its queue out while all that holds (tangram.sim.engine, with a margin on the
    # last; the load's window is the driver's to check)
    quiet: tuple[tuple[str, float, tuple[tuple[str, float, float], ...]], ...] = ()

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
    gave: list[tuple[ActionId, str]] = []  # Decision.assigned
    # per pool: the pool, its never_fits memo, its queue (None: no such pool)
    lanes: dict[str, tuple[SchedPool, dict[str, Shortfall | None], list[Action]] | None] = {}
    # read as a dict and a list (the daemon's and the benchmarks' types): compiled, their
    # get and iteration are direct calls, not method look-ups on a Mapping / Sequence
    given = snapshot.affinity
    affinity: dict[TrajectoryId, str] = given if isinstance(given, dict) else dict(given)
    pools = snapshot.pools
    queued = snapshot.waiting
    everyone: list[Action] = queued if isinstance(queued, list) else list(queued)
    unknown = _UNKNOWN  # a local: compiled, a module global is a dict look-up on every read
    # several jobs (or a capped one): each pool serves its queue in fair-share order
    # (tangram.sched.share); within a job the order stays FCFS
    ordered = everyone
    fair = fair_order(
        everyone, snapshot.jobs, snapshot.held, snapshot.totals, pools, affinity, snapshot.usage
    )
    if fair is not None:
        ordered = fair.order
        for action, why in fair.never:
            infeasible.append(Infeasible(action.id, why))
    joint = False  # an action needs units on several pools
    for action in ordered:
        if action.extra:
            never_extra = _extra_never(action, pools)
            if never_extra is not None:
                infeasible.append(Infeasible(action.id, never_extra))
                continue
            joint = True
        kind = action.kind  # pool_of(), inlined
        if kind == "exec":
            pid = affinity.get(action.trajectory)
            if pid is None:
                unplaced_new.append(action)
                continue
        else:
            pid = "gpu" if kind == "service" else action.key
        # the markers are read as Any: compiled (mypyc), a declared type is checked on read
        got: Any = lanes.get(pid, unknown)
        if got is unknown:
            pool = pools.get(pid)
            lane = lanes[pid] = None if pool is None else (pool, {}, [])
        else:
            lane = got
        if lane is None:
            infeasible.append(Infeasible(action.id, _no_pool(action, pid)))
            continue
        pool, never_memo, queue = lane
        # never_fits depends only on (kind, service, min_units, demand["mem"]), which
        # fit_key stands for; memoised because queues are long
        sig = action.fit_key
        got = never_memo.get(sig, unknown)
        if got is unknown:
            short = never_memo[sig] = pool.never_fits(action)
        else:
            short = got
        if short is not None:
            infeasible.append(Infeasible(action.id, short))
            continue
        queue.append(action)
    for pid, lane in lanes.items():
        if lane is not None and lane[2]:
            queues[pid] = lane[2]
    if unplaced_new:
        assigned, never = _assign_nodes(unplaced_new, snapshot, now, cfg)
        infeasible.extend(never)
        joining: dict[str, list[Action]] = {}  # per pool, in queue order
        for action, pid in assigned:
            joining.setdefault(pid, []).append(action)
            new_nodes.add(action.id)
            gave.append((action.id, pid))
        rank: dict[ActionId, int] = {}
        if fair is not None:  # joiners go in fair-share order, not seq order
            rank = {a.id: i for i, a in enumerate(ordered)}
        for pid, extra in joining.items():
            if fair is None:
                queues[pid] = _merge_by_seq(queues.get(pid, []), extra)
            else:
                both = [*queues.get(pid, []), *extra]
                queues[pid] = sorted(both, key=lambda a: rank[a.id])

    if joint:
        joined, objective, evicted = _schedule_joint(queues, new_nodes, snapshot, now, cfg)
        return _decision(joined, everyone, infeasible, objective, evicted, gave)
    placements: list[Placement] = []
    objective = 0.0
    evicted = 0
    quiet: list[tuple[str, float, tuple[tuple[str, float, float], ...]]] = []
    for pid in sorted(queues):
        pool = snapshot.pools[pid]
        result = _schedule_pool(pool, queues[pid], snapshot, now, cfg)
        objective += result.objective
        evicted += result.evicted
        if not result.placed:
            if result.quiet > now:
                quiet.append((pid, result.quiet, result.reads))
            continue
        units = pool.pick_units(result.placed)
        for (action, amount), unit_ids, dur in zip(result.placed, units, result.durs, strict=True):
            placements.append(
                Placement(action.id, pid, amount, unit_ids, dur, action.id in new_nodes)
            )
    return _decision(placements, everyone, infeasible, objective, evicted, gave, quiet)


def _decision(
    placements: list[Placement],
    everyone: list[Action],
    infeasible: list[Infeasible],
    objective: float,
    evicted: int,
    gave: list[tuple[ActionId, str]],
    quiet: list[tuple[str, float, tuple[tuple[str, float, float], ...]]] | None = None,
) -> Decision:
    gone = {p.action_id for p in placements}  # placed or infeasible: not waiting
    for inf in infeasible:
        gone.add(inf.action_id)
    waiting = tuple([aid for a in everyone if (aid := a.id) not in gone])
    return Decision(
        tuple(placements),
        waiting,
        tuple(infeasible),
        objective,
        evicted,
        tuple(gave),
        tuple(quiet) if quiet else (),
    )


def _extra_never(action: Action, pools: Mapping[str, SchedPool]) -> Shortfall | None:
    """Why an action's extra units can never be had (no such pool, or more than it
    holds), or None."""
    for pid, amount in action.extra:
        pool = pools.get(pid)
        if pool is None:
            return Shortfall(pid, amount, 0, 0, f"no pool {pid!r}: not configured")
        short = pool.never_fits(action)
        if short is not None:
            return short
    return None


def _schedule_joint(
    queues: dict[str, list[Action]],
    new_nodes: set[ActionId],
    snap: Snapshot,
    now: float,
    cfg: SchedConfig,
) -> tuple[list[Placement], float, int]:
    """The per-pool passes when some queued action has extra units (joint admission).

    Each pool's queue is offered without the actions whose extra units are not left in
    this pass (they wait, holding nothing); an offered one takes its extra units from what
    is left, and gives them back if its key pool does not place it. Non-API pools go
    first, then the API pools serve their own queues with the units left. Units are picked
    once per pool at the end, for its own placements and the extras together."""
    pools = snap.pools
    left: dict[str, int] = {}  # units left this pass on the pools extras draw from

    def free(pid: str) -> int:
        got = left.get(pid)
        if got is None:
            got = left[pid] = pools[pid].free_units()
        return got

    placed_on: dict[str, _PoolResult] = {}
    extras: dict[str, list[tuple[Action, int]]] = {}  # pool -> (action, amount) for extras
    objective = 0.0
    evicted = 0
    for pid in sorted(queues, key=lambda p: (p.startswith("api:"), p)):
        pool = pools[pid]
        offered: list[Action] = []
        for a in queues[pid]:
            if a.extra:
                if any(free(e) < n for e, n in a.extra):
                    continue  # waits for its extra units (it holds none)
                for e, n in a.extra:
                    left[e] -= n
            offered.append(a)
        api = pid.startswith("api:")
        cap = free(pid) if api else -1
        result = _schedule_pool(pool, offered, snap, now, cfg, cap)
        objective += result.objective
        evicted += result.evicted
        placed = {a.id for a, _ in result.placed}
        for a in offered:
            for e, n in a.extra:
                if a.id in placed:
                    extras.setdefault(e, []).append((a, n))
                else:
                    left[e] += n  # not placed: its extra units go back
        if api:
            left[pid] -= sum(amount for _, amount in result.placed)
        placed_on[pid] = result
    picked: dict[str, dict[ActionId, tuple[int, ...]]] = {}
    for pid, asks in extras.items():
        own = placed_on.get(pid)
        mine = own.placed if own is not None else []
        both = [*asks, *mine]
        picked[pid] = {a.id: u for (a, _), u in zip(both, pools[pid].pick_units(both), strict=True)}
    placements: list[Placement] = []
    for pid in sorted(placed_on):
        result = placed_on[pid]
        if not result.placed:
            continue
        got = picked.get(pid)
        if got is not None:
            units = [got[a.id] for a, _ in result.placed]
        else:
            units = pools[pid].pick_units(result.placed)
        for (action, amount), unit_ids, dur in zip(result.placed, units, result.durs, strict=True):
            also = tuple((e, picked[e][action.id]) for e, _ in action.extra)
            placements.append(
                Placement(action.id, pid, amount, unit_ids, dur, action.id in new_nodes, also)
            )
    return placements, objective, evicted


def _seq_sorted(actions: list[Action]) -> bool:
    """Whether ``actions`` are in ascending ``seq`` (FCFS) order already."""
    for i in range(1, len(actions)):  # noqa: SIM110 (compiled: a loop over native ints)
        if actions[i].seq < actions[i - 1].seq:
            return False
    return True


def _merge_by_seq(first: list[Action], second: list[Action]) -> list[Action]:
    """``sorted(first + second, key=seq)`` (stable: ``first``'s before ``second``'s on equal
    seqs), as one linear merge when both are in seq order already (they are: queues keep
    FCFS order), instead of a sort reading every action's seq through ``attrgetter``."""
    if not (_seq_sorted(first) and _seq_sorted(second)):
        return sorted([*first, *second], key=_SEQ)
    out: list[Action] = []
    i, j, n, m = 0, 0, len(first), len(second)
    while i < n and j < m:
        a, b = first[i], second[j]
        if b.seq < a.seq:
            out.append(b)
            j += 1
        else:
            out.append(a)
            i += 1
    if i < n:
        out.extend(first[i:])
    if j < m:
        out.extend(second[j:])
    return out


def _no_pool(action: Action, pid: str) -> Shortfall:
    requested = action.min_units
    what = action.service or action.api or pid
    return Shortfall(action.key, requested, 0, 0, f"no pool {pid!r} serves {what!r}")


# ----------------------------------------------------------------------------- node choice

# From this many CPU nodes on, _assign_nodes keeps the nodes ranked by memory load instead
# of scanning them all for each action (the same choice; compiled, the scan is cheaper up to
# ~16 nodes, the ranking 3x cheaper at 128). Not Final: tests set it to check both ways.
_RANK_NODES = 16


def _assign_nodes(
    actions: Sequence[Action], snap: Snapshot, now: float, cfg: SchedConfig
) -> tuple[list[tuple[Action, str]], list[Infeasible]]:
    """Memory-balanced node for each trajectory's first action (docs/design.md §5.2 placement)."""
    nodes: list[Any] = [p for pid, p in sorted(snap.pools.items()) if pid.startswith("cpu:")]
    # per node, by index in pool id order: free and reserved memory, free cores
    pids: list[str] = [p.pool_id for p in nodes]
    mem_free: list[int] = [p.mem_free for p in nodes]
    mem_used: list[int] = [p.mem_reserved for p in nodes]
    mem_total = [f + u for f, u in zip(mem_free, mem_used, strict=True)]  # never changes
    cores_free: list[int] = [p.free_units() for p in nodes]
    assigned: list[tuple[Action, str]] = []
    never: list[Infeasible] = []
    memo: dict[tuple[str, int], list[int]] = {}  # (node_key, env memory) -> nodes it fits
    fit_sets: dict[tuple[str, int], set[int]] = {}  # the same, as sets (when not all)
    most_free = max(cores_free, default=0)
    at_most = cores_free.count(most_free)  # how many nodes have most_free cores free
    most_mem = max(mem_free, default=0)  # every choice below needs the memory free
    # From _RANK_NODES nodes on, the nodes with a free core are kept in (memory load, index)
    # order, the order the choice below prefers; a node leaves when its last free core is
    # taken (no key amount is 0). Fewer: each choice scans them (cheaper there).
    rank = len(nodes) >= _RANK_NODES
    ranked: list[tuple[float, int]] = sorted(
        (mem_used[i] / total if total else 1.0, i)
        for i, total in enumerate(mem_total)
        if rank and cores_free[i] > 0
    )
    starvation_s, env_mem = cfg.starvation_s, snap.env_mem
    for action in actions:
        starving = now - action.submitted_at >= starvation_s
        need = action.min_units
        if need > most_free and not starving:
            continue  # no node has the cores now: it waits (cheap exit for long queues)
        need_mem = env_mem(action)
        sig = (action.node_key, need_mem)  # node_key: (min_units, demand["mem"])
        fits_ever = memo.get(sig)
        if fits_ever is None:
            fits_ever = memo[sig] = [
                i
                for i, p in enumerate(nodes)
                if p.never_fits(action) is None and need_mem <= mem_total[i]
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
        if need_mem > most_mem:
            continue  # no node has its memory free: it waits node-less (as below, sooner)
        at = -1  # k's place in ranked, when found there
        if len(fits_ever) == 1:  # one node it can ever fit: no choice to make
            k = fits_ever[0]
            if not starving and (mem_free[k] < need_mem or cores_free[k] < need):
                continue  # waits; the node has no room now
        else:
            # the node with room with the lowest memory load (used / total), ties by pool id
            # (nodes are in pool id order: the first of equal loads); none with room: it
            # waits, or when starving, the least loaded node it can ever fit
            k, best = -1, 0.0
            if rank and need >= 1:
                # the first node with room in (load, index) order is that node: most
                # often the first one looked at (the scan over every node was the
                # pass's one cost growing with queue x nodes, bench/sched.py --curve)
                among: set[int] | None = None  # None: it fits every node
                if len(fits_ever) != len(nodes):
                    among = fit_sets.get(sig)
                    if among is None:
                        among = fit_sets[sig] = set(fits_ever)
                for j in range(len(ranked)):
                    i = ranked[j][1]
                    room = mem_free[i] >= need_mem and cores_free[i] >= need
                    if room and (among is None or i in among):
                        k, at = i, j
                        break
            else:  # every node it fits, in order
                for i in fits_ever:
                    if mem_free[i] >= need_mem and cores_free[i] >= need:
                        total = mem_total[i]
                        load = mem_used[i] / total if total else 1.0
                        if k < 0 or load < best:
                            k, best = i, load
            if k < 0:
                if not starving:
                    continue  # waits; no node has room now
                for i in fits_ever:  # the least loaded with its memory free (cores busy)
                    if mem_free[i] >= need_mem:
                        total = mem_total[i]
                        load = mem_used[i] / total if total else 1.0
                        if k < 0 or load < best:
                            k, best = i, load
                if k < 0:
                    continue  # no node has its memory free: it waits node-less (below)
        if mem_free[k] >= need_mem:
            total = mem_total[k]
            if rank and cores_free[k] > 0 and at < 0:  # in the ranking, chosen without it
                at = _bisect_left(ranked, mem_used[k] / total if total else 1.0, k)
            if mem_free[k] == most_mem:
                most_mem = -1  # (read again below)
            mem_free[k] -= need_mem
            mem_used[k] += need_mem
            if most_mem < 0:
                most_mem = max(mem_free)
            cores = cores_free[k]
            left = cores - need
            cores_free[k] = left if left > 0 else 0
            if rank and cores > 0:  # its place moves up the ranking (load grew), or it leaves
                if left > 0:
                    moved = (mem_used[k] / total if total else 1.0, k)
                    if at + 1 == len(ranked) or moved < ranked[at + 1]:
                        ranked[at] = moved  # still before the next one: same place
                    else:
                        del ranked[at]
                        _insort(ranked, moved[0], k, at)
                else:
                    del ranked[at]
            if cores == most_free:  # only the node with the most free cores moves the max
                if not rank:
                    most_free = max(cores_free) if len(cores_free) > 1 else cores_free[k]
                elif left != cores:  # one node fewer holds the max
                    at_most -= 1
                    if at_most == 0:  # it was the last: the max moves (O(nodes), seldom)
                        most_free = max(cores_free)
                        at_most = cores_free.count(most_free)
            assigned.append((action, pids[k]))
        # else: no node has its memory free, starving or not. It waits node-less (not in
        # any pool's queue, so it is never placed where the driver cannot reserve its
        # memory) and is the first to be given a node when memory frees (FCFS order here).
        # Queueing it on a node without memory let the pool place it on that node's free
        # cores ("phantom" placements the driver refuses): it held those cores in every
        # pass, and with one node it blocked the actions of the trajectories that hold
        # the memory, so nothing ran and nothing freed it.
    return assigned, never


# ----------------------------------------------------------------------------- one pool


@dataclass(slots=True)
class _PoolResult:
    placed: list[tuple[Action, int]]
    durs: list[float]
    objective: float
    evicted: int
    # no candidate: the time before which none would be found at the same state (else -1),
    # and on what estimates (``Decision.quiet``)
    quiet: float = -1.0
    reads: tuple[tuple[str, float, float], ...] = ()


def _schedule_pool(
    pool: SchedPool,
    queue: Sequence[Action],
    snap: Snapshot,
    now: float,
    cfg: SchedConfig,
    cap: int = -1,
) -> _PoolResult:
    """One pool's placements; ``cap`` >= 0: at most that many of its free units (an API
    pool whose units extras of this pass took), else all of them."""
    op = pool.operator()
    if cap >= 0 and isinstance(op, BaseOperator) and cap < op.units(op.start()):
        op = BaseOperator(cap)
    if op.units(op.start()) == 0:  # a full pool starts nothing: no bands, no replay
        return _PoolResult([], [], 0.0, 0)  # (both candidate scans stop at once on 0 free)
    priced = cfg.rule == "priced" and isinstance(op, BaseOperator)
    load = snap.load.get(pool.pool_id, NO_LOAD)
    dur = Durations(pool, snap.estimate)
    if priced:
        max_single = dur.max_single
        dur.narrow(
            price_bands(
                queue,
                pool.capacity,
                load,
                lambda a: elastic_amounts(a, max_single),
                dur,
                dur.many,
                # a CPU node adds no extra cost (SchedPool.resource): bands memoised
                # across passes (price.py)
                max_single if pool.resource == "cpu" else -1,
            )
        )
    running_at = snap.running.get(pool.pool_id, ())

    def running() -> list[tuple[float, int]]:  # expected finishes from now, built on demand
        # max(f - now, 0.0) written out (same value, NaN included; built every pass)
        return [(0.0 if f - now < 0.0 else f - now, u) for f, u in running_at]

    # Decision.quiet: a CPU node (no extra cost) in FCFS order reports until when no
    # candidate would be found
    watch: list[float] | None = None
    estimated: dict[str, tuple[float, float]] = {}
    if cfg.quiet and cfg.order == "fcfs" and cap < 0 and pool.resource == "cpu":
        watch = []
    if priced and cfg.order == "fcfs":
        cands, rest = _candidates_easy(
            op.start(),
            queue,
            dur,
            running,
            now,
            now - cfg.starvation_s,
            load.elastic_mean_s,
            watch,
            estimated,
        )
    else:
        # (FCFS: the first action that does not fit ends the scan; the clock is not read)
        cands, rest = _candidates(op, queue, now, cfg, dur.low)
    if not cands:
        if watch is None:
            return _PoolResult([], [], 0.0, 0)
        reads = tuple([(k, v[0], v[1]) for k, v in estimated.items()])
        return _PoolResult([], [], 0.0, 0, _quiet_until(watch), reads)
    fixed: list[Action] = []
    elastic: list[Action] = []
    for a in cands:
        # priced: every elastic action goes through the DP and eviction, even a one-amount band
        if a.elastic and (priced or len(dur.choices(a)) > 1):
            elastic.append(a)
        else:
            fixed.append(a)
    if not elastic:  # the placement is fixed: no DP, no eviction, objective 0 (see below)
        lowest = [(a, a.min_units) for a in fixed]
        return _PoolResult(lowest, [dur(a, amount) for a, amount in lowest], 0.0, 0)
    state = op.start()
    if isinstance(op, BaseOperator):  # take(s, k) is s - k there (the prefix fit)
        for a in fixed:
            k = a.min_units
            assert 0 <= k <= state  # the candidate prefix fit at minimum
            state -= k
    else:
        for a in fixed:
            nxt = op.take(state, a.min_units)
            assert nxt is not None  # the candidate prefix fit at minimum
            state = nxt
    choices = [dur.table(a, dur.choices(a)) for a in elastic]
    table = DPTable(choices, op, start=state)
    n = len(elastic)
    while n > 0 and not table.feasible(n):  # chunk order effects: drop trailing candidates
        rest.append(elastic.pop())
        n -= 1
    if not _seq_sorted(rest):  # (it is unless candidates went back: a stable sort's no-op)
        rest.sort(key=_SEQ)
    # The replay window is a fixed set for every t (evicted candidates + the first
    # ``replay_limit`` non-candidates), so objective values of different t compare.
    window = rest[: cfg.replay_limit]
    # fixed candidates have no band: their lowest amount is their minimum
    fixed_heap = [(dur.minimum(a), a.min_units) for a in fixed]
    fixed_total = sum(d for d, _ in fixed_heap)
    base_heap = running() + fixed_heap
    replay = Replay(op, dur, cfg)

    base_heap.sort()  # a sorted list is a valid heap: copied, never re-heapified
    rank = {a.id: k for k, a in enumerate(elastic)}
    # both in seq order: a stable sort of the two runs is their merge (a linear pass)
    merged = _merge_by_seq(elastic, window)
    ranks = [rank.get(a.id, n) for a in merged]  # n: not a candidate, replayed at every t
    ents = replay.entries(merged)  # looked up once for every t's subset of merged

    def objective(t: int) -> tuple[float, list[int]]:
        arr = table.row(t)
        heap = list(base_heap)
        s = state
        for k, amount in enumerate(arr.amounts):
            nxt = op.take(s, amount)
            assert nxt is not None
            s = nxt
            heapq.heappush(heap, (choices[k][amount], amount))
        keep = [r >= t for r in ranks]
        waiting = list(compress(merged, keep))
        sub = None if ents is None else list(compress(ents, keep))
        return fixed_total + arr.total + replay.run(waiting, s, heap, sub), arr.amounts

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
    durs: list[float] = []
    chosen = dict(zip((a.id for a in elastic[:best_t]), best_amounts, strict=True))
    fixed_ids = {a.id for a in fixed}
    low = dur.low
    for a in cands:
        aid = a.id
        amount = chosen.get(aid)
        if amount is None:
            if aid not in fixed_ids:
                continue
            amount = a.min_units
        placed.append((a, amount))
        # at the lowest amount the duration is the cached minimum (the same computation)
        if amount == low.get(aid, a.min_units):
            durs.append(dur.minimum(a))
        else:
            durs.append(dur(a, amount))
    return _PoolResult(placed, durs, best, n - best_t)


def _candidates(
    op: Operator[Any],
    queue: Sequence[Action],
    now: float,
    cfg: SchedConfig,
    low: Mapping[ActionId, int],
) -> tuple[list[Action], list[Action]]:
    """FCFS prefix whose lowest amounts (``low``, else the minimum) fit jointly (or
    backfill up to the starvation bound)."""
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
        nxt = take(state, low.get(a.id, a.min_units))
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


def _quiet_until(watch: list[float]) -> float:
    """The earliest of the times in ``watch`` (a scan with no candidate may find one from
    then on), brought forward by a margin far above the rounding of the clock's
    subtractions (1e-6 of it, at least 1e-6 s); inf when none."""
    if not watch:
        return math.inf
    at = min(watch)
    return at - 1e-6 * max(1.0, abs(at))


def _candidates_easy(
    free: int,
    queue: Sequence[Action],
    dur: Durations,
    running: Callable[[], list[tuple[float, int]]],
    now: float,
    starved: float,
    long_s: float,
    watch: list[float] | None = None,
    estimated: dict[str, tuple[float, float]] | None = None,
) -> tuple[list[Action], list[Action]]:
    """FCFS prefix on plain unit counts where short calls pass waiting elastic actions.

    Elastic actions start in FCFS order among themselves: once one does not fit (at the
    lowest amount of its band), later ones wait. Non-elastic actions (short calls) that fit
    start past it: a waiting elastic action's band and the replay already price its wait,
    and a short call held behind it would wait for minutes. The blocked action gets an EASY
    reservation instead when it is non-elastic, when it has waited since ``starved`` or
    earlier (the starvation bound), or at once when it is *long*: expected to run longer
    (at the lowest amount of its band) than ``long_s``, the mean expected duration of the
    elastic actions in service (``PoolLoad.elastic_mean_s``; 0 when none started lately,
    then every blocked elastic action is long). The long runs are the ACT tail, and every
    short call that passes one delays it again. A reservation is the time ``shadow`` (from
    now) when enough units will be free by the expected finishes, and the ``extra`` units
    free beyond its need then; a later short call may start only if it is expected to end
    by ``shadow`` or takes only ``extra`` units. Behind an elastic action's reservation it
    may also start once it has itself waited its own expected duration: no short call is
    held there for longer (its slowdown stays at most 2; tool calls are most of the mean
    ACT, and the reservations for long runs come early). A blocked non-elastic action's
    reservation is strict EASY, as before (a fixed-DoP run is one).

    ``watch``: where the clock alone may change the scan's outcome later (with the same
    queue, units, running actions, durations and ``long_s``), the times are appended (read
    only when no candidate was found; see ``Decision.quiet``): an elastic action's
    starvation bound, the time a short call held behind an elastic action's reservation
    will have waited its run time, and, where a reservation was computed, the next
    expected finish (the busy list's order and the units free by the reservation hold
    until then: a finish past the clock counts as 0). A short call held whose duration
    is the history estimate of its class (it may change by then) goes into ``estimated``
    instead: per class, the largest reservation it was held by (it stays held while the
    estimate is above that: the reservation only comes closer) and, behind an elastic
    action's reservation, the earliest submission (held while the clock is before that
    plus the estimate).
    """
    cands: list[Action] = []
    rest: list[Action] = []
    low = dur.low
    held: list[tuple[float, int]] = []  # (expected duration, units) of this pass's starts
    shadow, extra = -1.0, 0
    bounded = False  # the reservation is an elastic action's: short calls' waits are bounded
    elastic_waits = False
    for i, a in enumerate(queue):
        if free == 0:
            rest.extend(queue[i:])
            break
        need = low.get(a.id, a.min_units)
        if a.elastic and (elastic_waits or shadow >= 0.0):
            rest.append(a)
            continue
        if need > free:
            rest.append(a)
            elastic_waits = elastic_waits or a.elastic
            if shadow < 0.0:
                if not a.elastic or a.submitted_at <= starved or dur.minimum(a) > long_s:
                    busy = [*running(), *held]
                    shadow, extra = _reservation(need, free, busy)
                    bounded = a.elastic
                    if watch is not None:
                        _reservation_watch(need, free, busy, now, watch)
                elif watch is not None:  # an elastic action not starving yet
                    watch.append(a.submitted_at + (now - starved))
            continue
        run_s = dur.minimum(a)
        if shadow >= 0.0 and run_s > shadow and not (bounded and now - a.submitted_at >= run_s):
            if need > extra:
                rest.append(a)
                if watch is not None and estimated is not None:  # (a shadow closer holds it)
                    if a.elasticity is None and a.dur_s is None:
                        sub = a.submitted_at if bounded else math.inf
                        got = estimated.get(a.klass)
                        if got is not None:
                            estimated[a.klass] = (max(got[0], shadow), min(got[1], sub))
                        else:
                            estimated[a.klass] = (shadow, sub)
                    elif bounded:
                        watch.append(a.submitted_at + run_s)
                continue
            extra -= need
        free -= need
        held.append((run_s, need))
        cands.append(a)
    return cands, rest


def _reservation_watch(
    need: int, free: int, busy: list[tuple[float, int]], now: float, watch: list[float]
) -> None:
    """``_candidates_easy``'s watch on a reservation: the next expected finish past now
    (then it counts as 0 and the order of ``busy`` may change), or now when the finishes
    where the reservation is met differ but are too close for their order to be sure of
    later (a rounding tie: the units free by then could differ)."""
    ahead = [f for f, _ in busy if f > 0.0]
    if ahead:
        watch.append(now + min(ahead))
    order = sorted(busy)
    for k in range(len(order)):
        if free >= need:
            # (equal finishes stay equal, and those past now stay 0)
            gap = order[k][0] - order[k - 1][0] if k > 0 else math.inf
            if 0.0 < gap <= 1e-6 * max(1.0, order[k][0]):
                watch.append(now)
            return
        free += order[k][1]


def _reservation(need: int, free: int, busy: list[tuple[float, int]]) -> tuple[float, int]:
    """(when ``need`` units will be free, how many more than ``need`` are free then)."""
    at = 0.0
    for finish, units in sorted(busy):
        if free >= need:
            break
        free += units
        at = finish
    if free < need:
        return 1e9, 0  # never by the expected finishes: nothing can delay it
    return at, free - need
