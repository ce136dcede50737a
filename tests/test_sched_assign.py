"""The node choice for trajectories without a node (``schedule._assign_nodes``).

From 16 nodes on it keeps the nodes ranked by memory load instead of scanning every node
for every action (the scan was the part of a pass growing with queue x nodes:
docs/results.md, ``bench/sched.py --curve``). The rule is unchanged: the node with room
with the lowest memory load, ties to the first in pool id order; none with room: the action
waits, or when starving, goes to the least loaded node with its memory free (its cores may
be busy: it queues there in FCFS order); none with its memory free: it waits node-less.
``reference`` below is that rule as the scan wrote it; the property test holds both ways to
it, decision for decision, on random clusters where memory, cores, node sizes and
starvation all bind.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence

import pytest

from tangram.model import Action, ActionId, EnvId, make_action
from tangram.pools.cpu import CpuNodePool
from tangram.sched import SchedConfig, Snapshot, schedule
from tangram.sched.schedule import _assign_nodes

GIB = 1 << 30


def reference(
    actions: Sequence[Action], snap: Snapshot, now: float, cfg: SchedConfig
) -> list[tuple[ActionId, str]]:
    """The node choice as one scan over every node per action (the rule, written plainly)."""
    nodes = [p for pid, p in sorted(snap.pools.items()) if pid.startswith("cpu:")]
    mem_free = [p.mem_free for p in nodes]
    mem_used = [p.mem_reserved for p in nodes]
    mem_total = [f + u for f, u in zip(mem_free, mem_used, strict=True)]
    cores_free = [p.free_units() for p in nodes]
    out: list[tuple[ActionId, str]] = []

    def load(i: int) -> float:
        return mem_used[i] / mem_total[i] if mem_total[i] else 1.0

    for action in actions:
        starving = now - action.submitted_at >= cfg.starvation_s
        need, need_mem = action.min_units, snap.env_mem(action)
        if need > max(cores_free, default=0) and not starving:
            continue
        fits = [
            i
            for i, p in enumerate(nodes)
            if p.never_fits(action) is None and need_mem <= mem_total[i]
        ]
        if not fits:
            continue  # never fits: reported infeasible (not compared here)
        room = [i for i in fits if mem_free[i] >= need_mem and cores_free[i] >= need]
        if room:
            k = min(room, key=lambda i: (load(i), i))
        elif starving and (mem_room := [i for i in fits if mem_free[i] >= need_mem]):
            k = min(mem_room, key=lambda i: (load(i), i))  # memory free, cores busy
        else:
            continue  # no room (starving: no node with its memory free): waits node-less
        mem_free[k] -= need_mem
        mem_used[k] += need_mem
        cores_free[k] = max(cores_free[k] - need, 0)
        out.append((action.id, nodes[k].pool_id))
    return out


def cluster(seed: int) -> tuple[Snapshot, float, SchedConfig]:
    rng = random.Random(seed)
    pools = {}
    for n in range(rng.randint(1, 40)):
        cores = rng.choice([2, 4, 8, 16, 32, 64])
        numa = rng.choice([1, 2]) if cores >= 8 else 1
        per = cores // numa
        mem = rng.choice([4, 8, 16, 64, 256]) * GIB
        pool = CpuNodePool(
            f"n{n:02d}", [list(range(i * per, (i + 1) * per)) for i in range(numa)], mem
        )
        busy = rng.randint(0, cores)
        if busy:
            pool.allocate(ActionId(f"busy{n}"), tuple(range(busy)))
        held = rng.randint(0, mem // GIB) * GIB
        if held and rng.random() < 0.5:
            assert pool.reserve_mem(EnvId(f"env{n}"), held)
        pools[pool.pool_id] = pool
    now = rng.choice([0.0, 20.0, 100.0])
    waiting = []
    mems: dict[str, int] = {}
    for i in range(rng.randint(1, 300)):
        at = rng.uniform(0, now)
        if rng.random() < 0.6:
            cpus = rng.choice([1, 1, 2, 4, 8, 40])
            a = make_action(f"a{i}", "exec", f"t{i}", {"cpu": cpus}, seq=i, dur_s=1.0,
                            submitted_at=at)  # fmt: skip
        else:
            lo = rng.choice([1, 2, 4, 16])
            amounts = sorted({lo, *rng.sample(range(lo, 70), 3)})
            a = make_action(f"a{i}", "exec", f"t{i}", {"cpu": {"set": amounts}}, seq=i,
                            t1_s=50.0, eff={m: 0.9 for m in amounts}, submitted_at=at)  # fmt: skip
        mems[a.id] = rng.choice([0, 1, 4, 4, 4, 32, 300]) * GIB
        waiting.append(a)
    snap = Snapshot(waiting=waiting, pools=pools, env_mem=lambda a: mems[a.id])
    return snap, now, SchedConfig(starvation_s=rng.choice([10.0, 30.0, 1e9]))


@pytest.mark.parametrize("rank_from", [2, 16, 10**9])  # always ranked / as shipped / never
def test_ranked_node_choice_decides_as_the_scan_over_every_node(monkeypatch, rank_from) -> None:
    monkeypatch.setattr(sys.modules["tangram.sched.schedule"], "_RANK_NODES", rank_from)
    assigned = starved_pins = 0
    for seed in range(400):
        snap, now, cfg = cluster(seed)
        got, _ = _assign_nodes(list(snap.waiting), snap, now, cfg)
        want = reference(snap.waiting, snap, now, cfg)
        assert [(a.id, pid) for a, pid in got] == want, seed
        assigned += len(want)
        starved_pins += sum(
            1 for a, pid in got if now - a.submitted_at >= cfg.starvation_s
        )  # fmt: skip
    # the clusters exercise the choice: many placements, starving ones among them
    assert assigned > 20_000 and starved_pins > 1_000, (assigned, starved_pins)


def test_balanced_by_memory_round_robin_on_equal_nodes() -> None:
    """Equal nodes, equal environments: the first actions go one per node in pool id order,
    then round again (each placement raises its node's load); a node with no core left
    drops out."""
    pools = {}
    for n in range(4):
        pool = CpuNodePool(f"n{n}", [[0, 1]], 64 * GIB)
        pools[pool.pool_id] = pool
    acts = [make_action(f"a{i}", "exec", f"t{i}", {"cpu": 1}, seq=i, dur_s=1.0) for i in range(10)]
    snap = Snapshot(waiting=acts, pools=pools, env_mem=lambda a: 4 * GIB)
    got, never = _assign_nodes(acts, snap, 0.0, SchedConfig())
    nodes = [pid for _, pid in got]
    assert nodes == ["cpu:n0", "cpu:n1", "cpu:n2", "cpu:n3"] * 2 and not never
    d = schedule(snap, 0.0, SchedConfig())
    assert sorted(p.pool_id for p in d.placements) == sorted(nodes)
    assert all(p.new_node for p in d.placements) and len(d.waiting) == 2


def test_starving_action_without_free_memory_waits_and_is_never_placed() -> None:
    """A starving first action whose node has free cores but no free memory waits node-less:
    it is not placed there (the driver could not reserve its memory), and the actions of the
    trajectories that hold the memory still get the cores (with one node, placing it held
    every free core and nothing ran: the simulation stalled)."""
    pool = CpuNodePool("n0", [[0, 1, 2, 3]], 8 * GIB)
    for held in ("old0", "old1"):
        assert pool.reserve_mem(EnvId(held), 4 * GIB)
    new = make_action("new", "exec", "tnew", {"cpu": 1}, seq=0, dur_s=1.0, submitted_at=0.0)
    olds = [
        make_action(f"a{i}", "exec", f"old{i}", {"cpu": 1}, seq=1 + i, dur_s=1.0, submitted_at=90.0)
        for i in range(2)
    ]
    snap = Snapshot(
        waiting=[new, *olds],
        pools={pool.pool_id: pool},
        affinity={a.trajectory: pool.pool_id for a in olds},
        env_mem=lambda a: 4 * GIB,
    )
    d = schedule(snap, 100.0, SchedConfig(starvation_s=30.0))  # new has waited 100 s
    assert sorted(p.action_id for p in d.placements) == ["a0", "a1"]
    assert d.waiting == ("new",) and not d.infeasible
    got, _ = _assign_nodes([new], snap, 100.0, SchedConfig(starvation_s=30.0))
    assert got == []


def test_starving_action_with_free_memory_is_pinned_though_cores_are_busy() -> None:
    """A starving first action goes to the node with its memory free even when no core is
    free there, and queues first in line (FCFS) for that node's cores."""
    pools = {}
    for n, busy in ((0, 4), (1, 4)):
        pool = CpuNodePool(f"n{n}", [[0, 1, 2, 3]], 8 * GIB)
        pool.allocate(ActionId(f"busy{n}"), tuple(range(busy)))
        pools[pool.pool_id] = pool
    assert pools["cpu:n0"].reserve_mem(EnvId("full"), 8 * GIB)  # n0: no memory
    new = make_action("new", "exec", "tnew", {"cpu": 1}, seq=0, dur_s=1.0, submitted_at=0.0)
    snap = Snapshot(waiting=[new], pools=pools, env_mem=lambda a: 4 * GIB)
    got, _ = _assign_nodes([new], snap, 100.0, SchedConfig(starvation_s=30.0))
    assert [(a.id, pid) for a, pid in got] == [("new", "cpu:n1")]
    d = schedule(snap, 100.0, SchedConfig(starvation_s=30.0))
    assert not d.placements and d.waiting == ("new",)
