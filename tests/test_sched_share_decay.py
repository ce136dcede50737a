"""Fair share over decayed usage ([sched] share_half_life_s, issue 34 item 2, burst goal)."""

from __future__ import annotations

import json
import random

import pytest
import tomllib

from tangram.model import TrajectoryId, make_action
from tangram.pools.cpu import CpuNodePool
from tangram.sched import SchedConfig, Snapshot, schedule
from tangram.sched.share import DecayedUsage, Job, fair_order
from tangram.sim.cluster import parse_cluster
from tangram.sim.engine import Engine
from tangram.sim.policy import parse_policy
from tangram.sim.trace import parse_lines

GIB = 1 << 30


def ex(i: int, job: str, cpus: object = 1):
    return make_action(f"a{i}", "exec", f"t{i}", {"cpu": cpus}, seq=i, dur_s=1.0, job=job)


def test_decayed_usage_is_the_exponential_average_of_units_held():
    d = DecayedUsage(10.0)
    held = {"B": {"cpu": 8}}
    assert d.update(5.0, held) == {"B": {"cpu": 0.0}}  # first call: no history yet
    d.update(15.0, held)  # one half-life holding 8
    assert d.avg["B"]["cpu"] == pytest.approx(8 * (1 - 0.5))
    d.update(35.0, {"A": {"cpu": 2}})  # two half-lives with B at 0, A at 2
    assert d.avg["B"]["cpu"] == pytest.approx(4 * 0.25)
    assert d.avg["A"]["cpu"] == pytest.approx(2 * (1 - 0.25))
    d.update(30.0, {})  # time going back: no time passes
    assert d.avg["B"]["cpu"] == pytest.approx(1.0)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="share_half_life_s"):
            DecayedUsage(bad)


def test_a_job_idle_for_a_while_is_served_ahead_of_one_that_held_units():
    """For 20 s B held 4 cores and A (waiting on its own calls) 1 at most; both hold 0 now
    and B's actions came first. Memoryless: the tie goes to B's earlier head. Decayed: A
    has used less, A goes first."""
    d = DecayedUsage(10.0)
    d.update(0.0, {"A": {"cpu": 1}, "B": {"cpu": 4}})
    usage = d.update(20.0, {"B": {"cpu": 4}}, waiting=["A"])
    assert usage["A"]["cpu"] < usage["B"]["cpu"]
    acts = [ex(0, "B"), ex(1, "B"), ex(2, "A"), ex(3, "A")]
    pool = CpuNodePool("n0", [[0]], 64 * GIB)
    base = {
        "waiting": acts,
        "pools": {pool.pool_id: pool},
        "affinity": {TrajectoryId(a.trajectory): pool.pool_id for a in acts},
        "jobs": {"A": Job("A"), "B": Job("B")},
        "held": {"A": {}, "B": {}},
    }
    memoryless = schedule(Snapshot(**base), 20.0)  # type: ignore[arg-type]
    decayed = schedule(Snapshot(**base, usage=usage), 20.0)  # type: ignore[arg-type]
    assert [p.action_id for p in memoryless.placements] == ["a0"]
    assert [p.action_id for p in decayed.placements] == ["a2"]
    order = fair_order(acts, base["jobs"], base["held"], {"cpu": 4}, usage=usage)
    assert order is not None and [a.id for a in order.order] == ["a2", "a3", "a0", "a1"]


def test_a_job_back_from_idle_starts_at_the_level_of_those_that_kept_running():
    """Idle time earns no credit: B, idle while A ran, comes back no lower than A (weight
    for weight); a job first seen with nobody else active starts at 0."""
    d = DecayedUsage(10.0)
    d.update(0.0, {"A": {"cpu": 8}})
    assert d.avg["A"] == {"cpu": 0.0}
    d.update(10.0, {"A": {"cpu": 8}})
    a_level = d.avg["A"]["cpu"]
    usage = d.update(10.0, {"A": {"cpu": 8}}, waiting=["B"], weights={"B": 2.0})
    assert usage["B"]["cpu"] == pytest.approx(2.0 * a_level)
    e = DecayedUsage(10.0)
    e.update(0.0, {"A": {"cpu": 8}})
    e.update(10.0, {"A": {"cpu": 8}})
    assert e.update(10.0, {"A": {"cpu": 8}}, waiting=["B"])["B"]["cpu"] == pytest.approx(a_level)


def test_usage_equal_to_what_is_held_gives_todays_order():
    """A job that has held the same units for many half-lives: the decayed usage is what it
    holds, and the order is the memoryless one (half-life 0 is that order by definition)."""
    rng = random.Random(7)
    for _ in range(50):
        names = ["A", "B", "C"]
        acts = [ex(i, rng.choice(names), cpus=rng.choice([1, 2, [1, 4]])) for i in range(30)]
        jobs = {n: Job(n, weight=rng.choice([1.0, 2.0, 3.0])) for n in names}
        held = {n: {"cpu": rng.randrange(0, 20)} for n in names}
        d = DecayedUsage(1.0)
        d.update(0.0, held)
        usage = d.update(1e4, held)
        plain = fair_order(acts, jobs, held, {"cpu": 64})
        decayed = fair_order(acts, jobs, held, {"cpu": 64}, usage=usage)
        assert plain is not None and decayed is not None
        assert [a.id for a in decayed.order] == [a.id for a in plain.order]


def test_caps_count_units_held_now_not_the_decayed_usage():
    acts = [ex(0, "A"), ex(1, "B"), ex(2, "A")]
    jobs = {"A": Job("A", max_cores=2), "B": Job("B")}
    out = fair_order(acts, jobs, {"A": {"cpu": 1}}, {"cpu": 8}, usage={"A": {"cpu": 0.0}})
    assert out is not None
    assert [a.id for a in out.order] == ["a0", "a1"] and [a.id for a in out.capped] == ["a2"]


def test_half_life_is_validated():
    with pytest.raises(ValueError, match="share_half_life_s"):
        SchedConfig(share_half_life_s=-1.0)
    with pytest.raises(ValueError, match="share_half_life_s"):
        SchedConfig(share_half_life_s=float("inf"))


CLUSTER = "step_train_s = 0.0\n[[cpu_node]]\ncount = 1\ncores = 4\nmem_gb = 64\n"


def _lines(jobs: tuple[str, ...]) -> list[str]:
    out = []
    for job in jobs:
        for i in range(6):
            steps = [{"action": {"kind": "exec", "dur_s": 1.0 + i % 3, "tag": job}}] * 5
            out.append(json.dumps({"id": f"{job}{i}", "job": job, "steps": steps}))
    return out


def _run(jobs: tuple[str, ...], half_life: float) -> list[tuple[str, float, int]]:
    cluster = parse_cluster(tomllib.loads(CLUSTER), "test")
    pol = parse_policy("tangram")
    cfg = SchedConfig(order=pol.order, rule=pol.rule, share_half_life_s=half_life)
    eng = Engine(cluster, parse_lines(_lines(jobs)), pol, cfg, jobs={j: Job(j) for j in jobs})
    eng.run()
    return sorted((r.action_id, r.start_s, r.units) for r in eng.records)


def test_one_job_runs_the_same_with_any_half_life():
    assert _run(("A",), 30.0) == _run(("A",), 0.0)


def test_two_jobs_in_the_simulator_with_decay_run_every_action():
    a, b = _run(("A", "B"), 0.0), _run(("A", "B"), 30.0)
    assert len(a) == len(b) == 60
    assert sorted(t for t, _, _ in a) == sorted(t for t, _, _ in b)


def test_config_key_is_validated_and_reaches_the_scheduler(tmp_path):
    from tangramd.config import ConfigError, load_config

    path = tmp_path / "t.toml"
    path.write_text("[sched]\nshare_half_life_s = 30\n")
    assert load_config(path, {}).sched.scheduler().share_half_life_s == 30.0
    path.write_text("[sched]\nshare_half_life_s = -5\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, {})
    assert info.value.key == "sched.share_half_life_s"
    assert "numbers >= 0" in str(info.value)


def test_daemon_keeps_the_decayed_usage_on_its_pass_book():
    """The daemon's pass advances one DecayedUsage with the pass's ``now`` (its own clock,
    passed in), and passes None at half-life 0."""
    from types import SimpleNamespace

    from tangramd.state.handlers.scheduling import decayed_usage
    from tangramd.state.passes import PassBook

    def core(h: float) -> SimpleNamespace:
        queued = SimpleNamespace(action=ex(0, "B"))
        return SimpleNamespace(
            cfg=SimpleNamespace(sched=SchedConfig(share_half_life_s=h), jobs={"A": Job("A")}),
            passer=PassBook(),
            actions=SimpleNamespace(queue={"a0": queued}),
        )

    assert decayed_usage(core(0.0), 5.0, {"A": {"cpu": 4}}) is None  # type: ignore[arg-type]
    c = core(10.0)
    decayed_usage(c, 0.0, {"A": {"cpu": 4}})  # type: ignore[arg-type]
    usage = decayed_usage(c, 10.0, {"A": {"cpu": 4}})  # type: ignore[arg-type]
    assert usage is not None and usage["A"]["cpu"] == pytest.approx(2.0)
    assert c.passer.decay is not None and c.passer.decay.last == 10.0
