"""bench/paper/hindsight.py: the choices give the amounts they say, a pinned trace runs each
test run at exactly its amount, pinning every one to 16 is fixed DoP 16, the search never
ends worse than where it started and reports its verdict from its own numbers, and bad
arguments are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_loader import REPO, load_script

from tangram.sim import generate, load_cluster
from tangram.sim.trace import TraceAction

SCRIPT = "bench/paper/hindsight.py"


def _module():
    return load_script(Path(SCRIPT), "hindsight_under_test")


def _trace(batch: int = 24):
    cluster = load_cluster(REPO / "config" / "cluster-mixed.toml")
    return cluster, generate("mixed", cluster, batch, seed=0)


def test_choices_give_the_frontier_amount_or_the_fixed_one():
    mod = _module()
    _, trace = _trace()
    tests = [a for t in trace for a in t.steps if mod.is_test(a)]
    assert tests
    for a in tests:
        ks = a.template.allowed_units()
        for lam in (0.0, 4.0, 16.0, 64.0):
            k = mod.amount(a, ("p", lam))
            cost = (k + lam) * a.true_duration(k)
            assert all(cost <= (j + lam) * a.true_duration(j) for j in ks)
        assert mod.amount(a, ("k", 16)) == max(j for j in ks if j <= 16)
        assert mod.amount(a, ("k", 0.5)) == ks[0]  # nothing fits: the least amount
    # a higher price never gives fewer units
    for a in tests:
        amounts = [mod.amount(a, ("p", lam)) for lam in (1.0, 8.0, 32.0, 128.0)]
        assert amounts == sorted(amounts)


def test_pinned_trace_runs_each_test_run_at_its_amount_and_leaves_the_rest():
    mod = _module()
    _, trace = _trace()
    ids = [f"{t.id}#{i}" for t in trace for i, a in enumerate(t.steps) if mod.is_test(a)]
    dop = {aid: 3 + n % 5 for n, aid in enumerate(ids)}
    out = mod.pinned(trace, dop)
    for t, p in zip(trace, out, strict=True):
        assert (t.id, t.arrival_s, len(t.steps)) == (p.id, p.arrival_s, len(p.steps))
        for i, (a, b) in enumerate(zip(t.steps, p.steps, strict=True)):
            aid = f"{t.id}#{i}"
            if aid in dop:
                assert isinstance(b, TraceAction)
                assert b.template.allowed_units() == (dop[aid],)
                assert b.true_duration(dop[aid]) == a.true_duration(dop[aid])
            else:
                assert b is a


def test_search_on_a_real_trace(capsys):
    mod = _module()
    assert mod.main(["--workload", "mixed", "--batch", "24", "--sweeps", "1",
                     "--workers", "1", "--prices", "4,16", "--amounts", "8,16",
                     "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    g, pol, h = out["goal"], out["policies"], out["hindsight"]
    fixed = ["fixed-dop:4", "fixed-dop:8", "fixed-dop:16"]
    assert g["best_all"] == min(fixed, key=lambda p: pol[p]["avg_act_s"])
    assert g["all_avg_goal_s"] == pol[g["best_all"]]["avg_act_s"]
    assert g["all_p99_goal_s"] == pol[g["best_all"]]["p99_act_s"]
    assert g["test_avg_goal_s"] == min(pol[p]["test_avg_act_s"] for p in fixed)
    # every test run pinned to (at most) 16 is fixed DoP 16, to the bit
    k16 = next(u for u in out["uniform"] if u["choice"] == "k:16")
    for key in ("avg_act_s", "p99_act_s", "test_avg_act_s", "tool_avg_act_s"):
        assert k16[key] == pol["fixed-dop:16"][key]

    def keeps(r):
        return r["avg_act_s"] <= g["all_avg_goal_s"] and r["p99_act_s"] <= g["all_p99_goal_s"]

    # the search starts at the best uniform vector and only moves to better ones
    assert len(h["choices"]) == len(out["windows"]) >= 1
    assert sum(w["test_runs"] for w in out["windows"]) == out["oracle_as_schedule"]["test_runs"]
    assert h["keeps_all_goal"] == keeps(h)
    for u in out["uniform"]:
        assert u["keeps_all_goal"] == keeps(u)
        if u["keeps_all_goal"]:
            assert h["keeps_all_goal"] and h["test_avg_act_s"] <= u["test_avg_act_s"]
    assert out["reached"] == (keeps(h) and h["test_avg_act_s"] <= g["test_avg_goal_s"])
    assert out["gap_to_goal"] == round(h["test_avg_act_s"] / g["test_avg_goal_s"] - 1, 4)
    for p, r in out["rules"].items():
        assert r["keeps_all_goal"] == keeps(pol[p])
    # the fig9 oracle's picks, as a schedule, never beat the picks themselves on paper
    o = out["oracle_as_schedule"]
    assert o["oracle_test_avg_act_s"] <= min(pol[p]["test_avg_act_s"] for p in pol)


def test_the_best_vector_reruns_to_the_same_numbers():
    mod = _module()
    res = mod.search("mixed", 24, 0, 30.0, [("p", 8.0), ("k", 16)], 1, 1, progress=False)
    _, labels, used, _ = mod.baseline("mixed", 24, 0, 30.0)
    assert [w * 30.0 for w in used] == [w["start_s"] for w in res["windows"]]
    best = tuple((c[0], float(c[2:])) for c in res["hindsight"]["choices"])
    mod._init("mixed", 24, 0, labels)
    try:
        again = mod.evaluate(best)
    finally:
        mod._W.clear()
    for key in ("avg_act_s", "p99_act_s", "test_avg_act_s", "test_runs"):
        assert again[key] == res["hindsight"][key]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--window", "0"], "--window"),
        (["--prices", "a,b"], "--prices"),
        (["--prices", "-1"], "--prices"),
        (["--amounts", "0"], "--amounts"),
        (["--sweeps", "-1"], "--sweeps"),
        (["--workers", "0"], "--workers"),
        (["--batch", "0"], "--batch"),
        (["--prices", "", "--amounts", ""], "at least one choice"),
    ],
)
def test_bad_arguments_are_refused_by_name(args, needle, capsys):
    mod = _module()
    with pytest.raises(SystemExit) as e:
        mod.main(args)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err
