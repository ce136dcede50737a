"""The scheduling pass: the core's queue and pools, as a snapshot, through ``schedule``.

A pass reads the queued actions, the pools, the environments' affinity and the recent
load, asks :func:`tangram.sched.schedule` for a decision, and carries it out: infeasible
actions end ``rejected``, placed ones get their units and start (an exec goes to its
node's backend, a call to its service host, a lease is granted). Passes are coalesced
(see :mod:`tangramd.state.core`); :class:`~tangramd.state.passes.PassBook` holds what
the passes remember between them, including what the short pass relies on
(:func:`short_waiting`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tangram.model import Action, ActionId, TrajectoryId
from tangram.pools.cpu import CpuNodePool
from tangram.sched import Decision, Infeasible, Placement, PoolLoad, SchedPool, Snapshot
from tangram.sched.explain import DopWhy, dop_why
from tangram.sched.replay import Durations
from tangram.sched.share import DecayedUsage
from tangramd import events as ev
from tangramd.collector import schedule_paused
from tangramd.state.handlers.actions import expire_waits, finish_action, run_exec
from tangramd.state.handlers.leases import grant_lease
from tangramd.state.handlers.services import start_call
from tangramd.state.story import PlacementNote, note

if TYPE_CHECKING:
    from tangramd.state.actions import ActionRec
    from tangramd.state.context import Core


def read_affinity(core: Core) -> dict[TrajectoryId, str]:
    """The environments' affinity, read afresh, and the count per CPU node derived
    from it (the priced rule's bound, ``PoolLoad.envs``): both cached together."""
    affinity = core.passer.affinity = core.envs.affinity()
    core.passer.envs_on = Counter(affinity.values())
    return affinity


def run_pass(core: Core, now: float, out: list[ev.Command]) -> None:
    core.passer.due = None
    core.passer.dirty = False
    if core.actions.deadlines:
        expire_waits(core, now, out)  # none placed past its deadline
    if not core.actions.queue:
        core.actions.fresh.clear()
        return  # nothing scheduled: the next arrival still finds the daemon quiet
    core.passer.last = now
    for pool in core.apis.values():
        pool.advance(now)
    short = None
    affinity = core.passer.affinity
    cached = affinity is not None
    if affinity is None:
        affinity = read_affinity(core)
    envs_on = core.passer.envs_on
    load = {
        p.pool_id: core.meter.load(p.pool_id, now, envs_on.get(p.pool_id, 0))
        for p in core.cpu.nodes
    }
    # several jobs (or a capped one): the pass orders the whole queue by fair share, so no
    # prefix decides it (short_waiting's proof assumes FCFS)
    jobs = core.cfg.jobs
    shared = len(core.jobs_seen) > 1 or any(
        j.max_cores is not None or j.max_gpus is not None for j in jobs.values()
    )
    if core.cfg.short_passes and not shared:
        short = short_waiting(core, affinity)
    if short is not None:
        decision = nothing_fits(core, short, affinity) or schedule_paused(
            Snapshot(
                waiting=short,
                pools=core.pools,
                affinity=affinity,
                estimate=core.history.estimate,
                load=load,
            ),
            now,
            core.cfg.sched,
        )
        if decision.infeasible and any(n.free_units() for n in core.cpu.nodes):
            short = None  # the prefix may shift past an infeasible action: read it all
        else:
            core.passer.short += 1
            waiting: Sequence[Action] = short
    if short is None:
        if cached:  # never a cached one here (one read in this pass is fresh)
            affinity = read_affinity(core)
        running: dict[str, list[tuple[float, int]]] = {}
        held: dict[str, dict[str, int]] = {}  # job -> resource -> units its running hold
        for rec in core.actions.live.values():
            if rec.state == "running" and rec.pool_id:
                started = rec.started_at if rec.started_at is not None else now
                exp = started + rec.expected_s
                if exp <= now:  # overdue: expect it to run about as long again as it has
                    exp = now + (now - started)
                units = len(rec.units) or 1
                running.setdefault(rec.pool_id, []).append((exp, units))
                if shared:
                    mine = held.setdefault(rec.action.job, {})
                    r = core.pools[rec.pool_id].resource
                    mine[r] = mine.get(r, 0) + units
                    for pid, also in rec.also:
                        mine[pid] = mine.get(pid, 0) + len(also)
        snap = Snapshot(
            waiting=[rec.action for rec in core.actions.queue.values()],
            pools=core.pools,
            affinity=affinity,
            running=running,
            estimate=core.history.estimate,
            load=load,
            jobs=jobs,
            held=held,
            usage=decayed_usage(core, now, held) if shared else None,
        )
        decision = schedule_paused(snap, now, core.cfg.sched)
        waiting = snap.waiting
        core.passer.seen_plain = all(
            rec.action.kind == "exec" and rec.action.trajectory in affinity
            for rec in core.actions.queue.values()
        )
    core.actions.fresh.clear()
    core.passer.seen_affinity = affinity
    core.passer.seen_pools = pool_identity(core)
    core.passer.passes += 1
    for inf in decision.infeasible:
        rec = core.actions[inf.action_id]
        finish_action(
            core,
            rec,
            now,
            out,
            outcome="rejected",
            detail=f"infeasible: {inf.shortfall.describe()}",
            error=("unschedulable", inf.shortfall.describe()),
        )
    queued: dict[str, int] = {}  # elastic actions queued per pool in the pass (dop_why)
    # (a batch's riders are queued calls this pass does not place itself)
    core.services.placing = frozenset(p.action_id for p in decision.placements)
    for p in decision.placements:
        placed = core.actions.unqueue(p.action_id)
        assert placed is not None, "the scheduler places queued actions only"
        rec = placed
        pool = core.pools[p.pool_id]
        why = None
        if rec.action.kind == "exec":
            why = placement_why(core, rec, p, pool, load, waiting, decision, queued)
        pool.allocate(p.action_id, p.units)
        for pid, slots in p.also:  # joint admission: its other units, in the same step
            core.pools[pid].allocate(p.action_id, slots)
        rec.pool_id = p.pool_id
        rec.units = p.units
        rec.also = p.also
        rec.started_at = now
        rec.expected_s = p.expected_s
        env = core.envs.get(rec.env) if rec.env else None
        if rec.action.kind == "exec":
            elastic = rec.action.elastic
            throwaway = env is not None and env.throwaway
            core.meter.started(
                p.pool_id, p.action_id, now, elastic, p.amount, p.expected_s, throwaway
            )
        node = env.node if env else None
        note(
            rec,
            now,
            "placed",
            PlacementNote(p.pool_id, p.units, node, p.expected_s, why),
            core.stimulus,
        )
        if p.also:
            holds = " ".join(f"{pid} units {list(units)}" for pid, units in p.also)
            note(rec, now, "also holds", holds, core.stimulus)
        if rec.action.kind == "exec":
            core.actions.move(rec, "running", now, "exec sent to the backend", core.stimulus)
            run_exec(core, rec, out)
        elif rec.action.kind == "service":
            start_call(core, rec, now, out)
        else:
            core.actions.move(rec, "running", now, "lease granted", core.stimulus)
            grant_lease(core, rec, now, out)
    core.services.placing = frozenset()
    for api in core.apis.values():  # a quota used up: look again when its window opens
        at = api.next_window_at(now)
        if at is not None:
            core.passer.windows.set(api.pool_id, at)


def decayed_usage(
    core: Core, now: float, held: dict[str, dict[str, int]]
) -> dict[str, dict[str, float]] | None:
    """Each job's decayed usage (``[sched] share_half_life_s`` > 0), advanced to ``now``
    with what its running actions hold; None: the memoryless share (half-life 0)."""
    h = core.cfg.sched.share_half_life_s
    if h <= 0.0:
        return None
    decay = core.passer.decay
    if decay is None or decay.half_life_s != h:
        decay = core.passer.decay = DecayedUsage(h)
    waiting = {rec.action.job for rec in core.actions.queue.values()}
    weights = {name: job.weight for name, job in core.cfg.jobs.items()}
    return decay.update(now, held, waiting, weights)


def placement_why(
    core: Core,
    rec: ActionRec,
    p: Placement,
    pool: SchedPool,
    load: dict[str, PoolLoad],
    waiting: Sequence[Action],
    decision: Decision,
    queued: dict[str, int],
) -> DopWhy:
    """Why an exec got ``p.amount`` cores, from this pass's inputs (its story's placement
    note: ``tangram.sched.explain``); ``queued`` memoises the elastic queue per pool."""
    action = rec.action
    count = queued.get(p.pool_id)
    if count is None and action.elastic:
        new = {q.action_id for q in decision.placements if q.new_node and q.pool_id == p.pool_id}
        affinity = core.passer.affinity or {}
        count = queued[p.pool_id] = sum(
            1
            for a in waiting
            if a.elastic and (affinity.get(a.trajectory) == p.pool_id or a.id in new)
        )
    named = rec.spec.profile if rec.spec is not None else None
    flat = named is not None and not core.profiles.get(named, {}).get("elastic", True)
    return dop_why(
        action,
        p.amount,
        pool.free_units(),
        rule=core.cfg.sched.rule,
        load=load.get(p.pool_id),
        queued=count or 0,
        capacity=pool.capacity,
        dur=lambda a, ks: Durations(pool, core.history.estimate).many(a, ks),  # elastic only
        profile_not_elastic=named if flat else None,
    )


def nothing_fits(
    core: Core, short: list[Action], affinity: dict[TrajectoryId, str]
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
        pool = core.pools.get(pid)
        if not isinstance(pool, CpuNodePool) or pool.free_units():
            return None
        shortfall = pool.never_fits(action)  # (two comparisons: not worth a memo here)
        if shortfall is not None:
            infeasible.append(Infeasible(action.id, shortfall))
    core.passer.full_pools += 1
    bad = {i.action_id for i in infeasible}
    waiting = tuple(a.id for a in short if a.id not in bad)
    return Decision((), waiting, tuple(infeasible), 0.0, 0)


def pool_identity(core: Core) -> tuple[tuple[str, int], ...]:
    return tuple((pid, id(pool)) for pid, pool in core.pools.items())


def short_waiting(core: Core, affinity: dict[TrajectoryId, str]) -> list[Action] | None:
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
    if not core.passer.seen_plain or (
        affinity is not core.passer.seen_affinity and affinity != core.passer.seen_affinity
    ):
        return None
    if pool_identity(core) != core.passer.seen_pools:
        return None
    to_fill: dict[str, int] = {}
    for node in core.cpu.nodes:
        free = node.free_units()
        if free:
            to_fill[node.pool_id] = free
    picked: list[Action] = []
    fresh = core.actions.fresh
    seen: set[ActionId] = set()  # fresh actions inside the prefix
    for aid, rec in core.actions.queue.items():
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
            if action.elastic or action.min_units != 1 or action.extra:
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
        late = core.actions.queue.get(aid)
        if late is None or aid in seen:
            continue
        action = late.action
        if action.kind != "exec" or action.trajectory not in affinity:
            return None
        picked.append(action)
    return picked
