"""Fair share across jobs on the pure core (tangram.sched.share, issue 34 item 2)."""

from __future__ import annotations

import pytest

from tangram.model import TrajectoryId, make_action
from tangram.pools.cpu import CpuNodePool
from tangram.sched import Snapshot, schedule
from tangram.sched.share import Job, dominant_share, fair_order

GIB = 1 << 30


def node(n: int, name: str = "n0") -> CpuNodePool:
    return CpuNodePool(name, [list(range(n))], 64 * GIB)


def ex(i: int, job: str, cpus: object = 1, dur: float = 1.0):
    return make_action(f"a{i}", "exec", f"t{i}", {"cpu": cpus}, seq=i, dur_s=dur, job=job)


def snap(pools: list[CpuNodePool], actions, **kw) -> Snapshot:
    on = pools[0].pool_id
    return Snapshot(
        waiting=actions,
        pools={p.pool_id: p for p in pools},
        affinity={TrajectoryId(a.trajectory): on for a in actions},
        **kw,
    )


def started(decision, actions) -> dict[str, int]:
    job = {a.id: a.job for a in actions}
    out: dict[str, int] = {}
    for p in decision.placements:
        out[job[p.action_id]] = out.get(job[p.action_id], 0) + p.amount
    return out


def interleaved(n: int) -> list:
    """``n`` 1-core actions of job A and ``n`` of job B, alternating in submission order."""
    return [ex(i, "A" if i % 2 == 0 else "B") for i in range(2 * n)]


def test_one_job_without_a_cap_is_not_reordered():
    acts = [ex(i, "default") for i in range(5)]
    assert fair_order(acts, {}, {}, {"cpu": 4}) is None
    assert fair_order(acts, {"default": Job("default", weight=3.0)}, {}, {"cpu": 4}) is None
    capped = fair_order(acts, {"default": Job("default", max_cores=2)}, {}, {"cpu": 4})
    assert capped is not None
    assert [a.id for a in capped.order] == ["a0", "a1"]
    assert [a.id for a in capped.capped] == ["a2", "a3", "a4"]


def test_one_job_pass_is_unchanged_by_job_terms():
    acts = [ex(i, "default", cpus=[1, 2]) for i in range(6)]
    plain = schedule(snap([node(4)], acts), 0.0)
    with_jobs = schedule(
        snap([node(4)], acts, jobs={"default": Job("default", 2.0)}, held={"default": {"cpu": 3}}),
        0.0,
    )
    assert plain == with_jobs


def test_weights_2_to_1_share_freed_units():
    acts = interleaved(10)
    jobs = {"A": Job("A", weight=2.0), "B": Job("B", weight=1.0)}
    d = schedule(snap([node(6)], acts, jobs=jobs), 0.0)
    assert started(d, acts) == {"A": 4, "B": 2}
    # equal weights: 3 and 3
    d = schedule(snap([node(6)], acts), 0.0)
    assert started(d, acts) == {"A": 3, "B": 3}


def test_units_held_count_against_the_job():
    """A job already holding units (an elastic action above its minimum included: the driver
    counts every unit it holds) is served after the job below its share."""
    acts = interleaved(10)
    d = schedule(snap([node(4)], acts, held={"A": {"cpu": 4}}, totals={"cpu": 8}), 0.0)
    assert started(d, acts) == {"B": 4}
    d = schedule(snap([node(4)], acts, held={"A": {"cpu": 2}}, totals={"cpu": 8}), 0.0)
    assert started(d, acts) == {"A": 1, "B": 3}


def test_priority_is_strict_and_weights_do_not_cross_it():
    acts = interleaved(10)
    jobs = {"A": Job("A", weight=100.0), "B": Job("B", priority=1)}
    d = schedule(snap([node(6)], acts, jobs=jobs, held={"B": {"cpu": 50}}, totals={"cpu": 56}), 0.0)
    assert started(d, acts) == {"B": 6}


def test_dominant_resource_counts_gpus_and_api_slots():
    assert dominant_share({"cpu": 8, "gpu": 1}, {"cpu": 64, "gpu": 2}) == 0.5
    assert dominant_share({"cpu": 8, "api:x": 2}, {"cpu": 64, "api:x": 4}, weight=2.0) == 0.25
    acts = interleaved(6)
    # A holds half the GPUs: its dominant share (0.5) is above B's 1/8 of the cores
    order = fair_order(acts, {}, {"A": {"gpu": 1}, "B": {"cpu": 1}}, {"cpu": 8, "gpu": 2})
    assert order is not None
    assert [a.job for a in order.order[:4]] == ["B", "B", "B", "A"]


def test_cap_holds_a_job_and_a_minimum_over_the_cap_is_infeasible():
    acts = [ex(0, "A", cpus=3), ex(1, "A"), ex(2, "B"), ex(3, "A"), ex(4, "A")]
    jobs = {"A": Job("A", max_cores=2)}
    d = schedule(snap([node(8)], acts, jobs=jobs, held={"A": {"cpu": 1}}), 0.0)
    assert [i.action_id for i in d.infeasible] == ["a0"]
    assert "max_cores" in d.infeasible[0].shortfall.reason
    assert sorted(p.action_id for p in d.placements) == ["a1", "a2"]
    assert set(d.waiting) == {"a3", "a4"}


def test_ties_go_to_the_earlier_head_and_order_within_a_job_is_fcfs():
    acts = [ex(0, "B"), ex(1, "B"), ex(2, "A"), ex(3, "A")]
    order = fair_order(acts, {}, {}, {"cpu": 4})
    assert order is not None
    assert [a.id for a in order.order] == ["a0", "a2", "a1", "a3"]


def test_job_terms_are_validated():
    with pytest.raises(ValueError, match="weight"):
        Job("A", weight=0.0)
    with pytest.raises(ValueError, match="max_cores"):
        Job("A", max_cores=-1)
    with pytest.raises(ValueError, match="name"):
        Job("")


def test_a_unit_its_pool_cannot_give_is_not_counted_against_its_job():
    """Two nodes with one free core each; job A (weight 2) holds 1 core, B 1 of 4. A's
    second action waits on the node A just filled: counting it would let B take the other
    node's core. It is not counted, so A's action on the other node starts there."""
    n0, n1 = node(2, "n0"), node(2, "n1")
    n0.allocate("busy0", (0,))
    n1.allocate("busy1", (0,))
    acts = [ex(0, "A"), ex(1, "A"), ex(2, "A"), ex(3, "B")]
    where = {"t0": n0.pool_id, "t1": n0.pool_id, "t2": n1.pool_id, "t3": n1.pool_id}
    snap_ = Snapshot(
        waiting=acts,
        pools={n0.pool_id: n0, n1.pool_id: n1},
        affinity={TrajectoryId(t): p for t, p in where.items()},
        jobs={"A": Job("A", weight=2.0)},
        held={"A": {"cpu": 1}, "B": {"cpu": 1}},
    )
    d = schedule(snap_, 0.0)
    assert sorted(p.action_id for p in d.placements) == ["a0", "a2"]
