"""Joint admission (issue 34, item 3): an action with units on several pools (an exec's
cores + one slot of an API) starts only when all of them fit, and holds them together."""

from __future__ import annotations

import pytest

from tangram.model import ActionId, InvalidDemand, TrajectoryId, make_action
from tangram.pools.api import ApiPool
from tangram.pools.cpu import CpuNodePool
from tangram.sched import SchedConfig, Snapshot, schedule
from tangram.sched.pool import SchedPool

GIB = 1 << 30


def joint(i: int, api: str = "search", cpus: int = 1, traj: str | None = None):
    """An exec needing ``cpus`` cores and one slot of ``api``."""
    demand = {"cpu": cpus, f"api:{api}": 1}
    return make_action(f"a{i}", "exec", traj or f"t{i}", demand, seq=i, dur_s=1.0)


def plain(i: int, cpus: int = 1):
    return make_action(f"a{i}", "exec", f"t{i}", {"cpu": cpus}, seq=i, dur_s=1.0)


def lease(i: int, api: str = "search"):
    return make_action(f"a{i}", "api", f"t{i}", {f"api:{api}": 1}, seq=i, dur_s=1.0)


class Driver:
    """What the daemon does with a decision: reserve every unit of a placement (its key
    pool's and its ``also``), release them all when the action ends."""

    def __init__(self, cores: int = 8, concurrency: int = 1) -> None:
        self.cpu = CpuNodePool("n0", [list(range(cores))], 64 * GIB)
        self.api = ApiPool("search", concurrency=concurrency)
        self.pools: dict[str, SchedPool] = {"cpu:n0": self.cpu, "api:search": self.api}
        self.queue: list = []
        self.running: dict[ActionId, list[str]] = {}  # action -> pools it holds units on

    def submit(self, *actions) -> None:
        self.queue.extend(actions)

    def step(self, now: float = 0.0):
        affinity = {TrajectoryId(a.trajectory): "cpu:n0" for a in self.queue}
        snap = Snapshot(waiting=list(self.queue), pools=self.pools, affinity=affinity)
        decision = schedule(snap, now, SchedConfig())
        for p in decision.placements:
            self.pools[p.pool_id].allocate(p.action_id, p.units)
            held = [p.pool_id]
            for pid, units in p.also:
                self.pools[pid].allocate(p.action_id, units)
                held.append(pid)
            self.running[p.action_id] = held
        placed = decision.placed_ids()
        self.queue = [a for a in self.queue if a.id not in placed]
        self.api.validate()
        assert self.api.in_use <= self.api.concurrency
        return decision

    def finish(self, aid: str) -> None:
        for pid in self.running.pop(ActionId(aid)):
            self.pools[pid].release(ActionId(aid))


def test_cores_and_api_wait_for_the_slot_hold_both_release_both() -> None:
    d = Driver(cores=8, concurrency=1)
    d.submit(joint(0), joint(1), joint(2))
    first = d.step()
    assert [p.action_id for p in first.placements] == ["a0"]
    (p,) = first.placements
    assert p.pool_id == "cpu:n0" and len(p.units) == 1
    assert p.also == (("api:search", (0,)),)  # the slot, on the same placement
    assert set(first.waiting) == {"a1", "a2"}  # cores are free: they wait for the API
    assert d.api.in_use == 1 and d.cpu.free_units() == 7
    assert not d.step().placements  # the slot is still held: nothing more starts
    d.finish("a0")
    assert d.api.in_use == 0 and d.cpu.free_units() == 8  # both released
    assert [p.action_id for p in d.step().placements] == ["a1"]
    d.finish("a1")
    assert [p.action_id for p in d.step().placements] == ["a2"]
    d.finish("a2")
    assert d.api.in_use == 0 and d.cpu.free_units() == 8 and not d.queue


def test_api_free_but_cores_full_holds_no_slot() -> None:
    d = Driver(cores=2, concurrency=2)
    d.submit(plain(0, cpus=2), joint(1))
    assert [p.action_id for p in d.step().placements] == ["a0"]
    assert d.api.in_use == 0  # nothing held while it waits for cores: no partial hold
    d.finish("a0")
    decision = d.step()
    assert [p.action_id for p in decision.placements] == ["a1"]
    assert d.api.in_use == 1 and d.cpu.free_units() == 1


def test_never_more_holders_than_concurrency_with_leases_and_joint_actions() -> None:
    d = Driver(cores=16, concurrency=2)
    d.submit(*(lease(i) if i % 3 == 0 else joint(i) for i in range(12)))
    done = 0
    for rnd in range(30):
        d.step(float(rnd))
        assert len(d.running) <= 2  # every running action holds a slot here
        if not d.running:
            break
        d.finish(sorted(d.running)[0])
        done += 1
    assert done == 12 and not d.queue


def test_plain_actions_pass_one_waiting_for_the_api() -> None:
    d = Driver(cores=4, concurrency=1)
    d.submit(joint(0), joint(1), plain(2))
    decision = d.step()
    assert {p.action_id for p in decision.placements} == {"a0", "a2"}
    assert decision.waiting == ("a1",)


def test_unknown_api_is_infeasible_and_net_is_refused() -> None:
    d = Driver()
    d.submit(joint(0, api="nope"))
    decision = d.step()
    assert not decision.placements
    (inf,) = decision.infeasible
    assert inf.shortfall.resource == "api:nope" and "not configured" in inf.shortfall.reason
    with pytest.raises(InvalidDemand) as err:
        make_action("x", "exec", "t", {"cpu": 1, "net": 100})
    assert err.value.field == "demand.net"
    assert "api:<name>" in err.value.allowed and "cpu" in err.value.allowed


def test_more_than_concurrency_is_infeasible() -> None:
    d = Driver(concurrency=1)
    d.submit(make_action("a0", "exec", "t0", {"cpu": 1, "api:search": 2}, dur_s=1.0))
    (inf,) = d.step().infeasible
    assert inf.shortfall.resource == "api:search"


def test_trajectories_without_a_node_get_one_and_still_wait_for_the_slot() -> None:
    cpu = CpuNodePool("n0", [list(range(4))], 64 * GIB)
    api = ApiPool("search", concurrency=1)
    pools: dict[str, SchedPool] = {"cpu:n0": cpu, "api:search": api}
    decision = schedule(Snapshot(waiting=[joint(0), joint(1), joint(2)], pools=pools), 0.0)
    (p,) = decision.placements
    assert p.action_id == "a0" and p.new_node and p.also == (("api:search", (0,)),)
    assert decision.waiting == ("a1", "a2")
