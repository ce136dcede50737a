"""bench/paper/elastic_frontier.py: the test runs' core-seconds frontier is a lower bound that
every simulated schedule respects, each run splits into run + wait, the goals' budgets follow
from the fixed DoPs' runs, and bad arguments are refused by name."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
from script_loader import load_script

SCRIPT = Path(__file__).parents[1] / "bench" / "paper" / "elastic_frontier.py"


def _module():
    return load_script(SCRIPT, "elastic_frontier_under_test")


def test_frontier_by_hand():
    mod = _module()
    # run a: 100 s on 1 unit, 60 s on 2, 50 s on 4 (core-s 100, 120, 200);
    # run b: 10 s on 1, 5 s on 2 (core-s 10, 10)
    runs = [[(1, 100.0), (2, 60.0), (4, 50.0)], [(1, 10.0), (2, 5.0)]]
    pts = mod.frontier(runs, lambdas=(1, 10, 1000))
    # λ = 1: a minimises (k + 1) t: 200, 180, 250 -> 2 units; b: 20, 15 -> 2 units
    assert pts[0] == {"lambda": 1, "mean_run_s": 32.5, "mean_units": 2.0, "core_s": 130.0}
    # λ = 10: a: 1100, 720, 700 -> 4 units; b -> 2 units
    assert pts[1] == {"lambda": 10, "mean_run_s": 27.5, "mean_units": 3.0, "core_s": 210.0}
    assert pts[2]["mean_run_s"] == 27.5  # the fastest amounts: nothing beyond
    # the hull: (27.5, 210) fastest, (32.5, 130), (52.5, 110) cheapest (a on 1 unit)
    least = mod.least_core_s
    assert least(runs, 27.5) == 210.0 and least(runs, 32.5) == 130.0
    assert least(runs, 30.0) == pytest.approx(170.0)
    assert least(runs, 40.0) == pytest.approx(130.0 - 20.0 * 7.5 / 20.0)
    assert least(runs, 52.5) == 110.0 and least(runs, 80.0) == 110.0  # no cheaper choice
    assert least(runs, 20.0) is None  # faster than every run at its fastest


def test_the_hull_bounds_every_choice_and_touches_the_priced_ones():
    mod = _module()
    rng = random.Random(7)
    for _ in range(40):
        runs = []
        for _ in range(rng.randint(1, 4)):
            t1 = rng.uniform(10.0, 300.0)
            f = rng.uniform(0.01, 0.6)  # Amdahl: t(k) = t1 (f + (1 - f) / k), a few amounts
            ks = sorted(rng.sample(range(1, 17), rng.randint(1, 5)))
            runs.append([(k, t1 * (f + (1 - f) / k)) for k in ks])
        n = len(runs)
        for choice in itertools.product(*runs):  # every choice of one amount per run
            x = sum(d for _, d in choice) / n
            cs = sum(k * d for k, d in choice)
            bound = mod.least_core_s(runs, x)
            assert bound is not None and cs >= bound - 1e-6 * cs
        for p in mod.frontier(runs, lambdas=(0.5, 2, 8, 32)):
            bound = mod.least_core_s(runs, p["mean_run_s"])
            assert bound == pytest.approx(p["core_s"], rel=1e-5, abs=0.2)  # on the hull


def test_real_runs_respect_the_frontier(capsys):
    mod = _module()
    argv = ["--workload", "mixed", "--batch", "48", "--json"]
    assert mod.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["workload"], doc["batch"], doc["seed"]) == ("mixed", 48, 0)
    pts = doc["frontier"]
    runs = [p["mean_run_s"] for p in pts]
    cores = [p["core_s"] for p in pts]
    assert runs == sorted(runs, reverse=True) and cores == sorted(cores)
    assert set(doc["policies"]) == {"tangram", "fixed-dop:4", "fixed-dop:8", "fixed-dop:16"}
    waited = 0
    for name, row in doc["policies"].items():
        assert row["avg_act_s"] == pytest.approx(row["run_s"] + row["wait_s"], abs=2e-4), name
        assert row["test_avg_act_s"] == pytest.approx(
            row["test_run_s"] + row["test_wait_s"], abs=2e-4
        )
        least = row["least_test_core_s"]
        assert least is not None, name  # every policy's mean run lies within the frontier
        # no schedule runs its test runs that long on average on fewer core-seconds
        assert row["test_core_s"] >= least * (1 - 1e-9), name
        waited += row["wait_s"] > 0
    assert waited >= 2  # batch 48 on 4 x 64 cores: some policies queue
    goal = doc["goal"]
    fixed = {k: v for k, v in doc["policies"].items() if k.startswith("fixed-dop:")}
    assert goal["best_all"] == min(fixed, key=lambda k: fixed[k]["avg_act_s"])
    assert goal["best_test"] == min(fixed, key=lambda k: fixed[k]["test_avg_act_s"])
    a, t = goal["all_avg_goal_s"], goal["test_avg_goal_s"]
    for b in goal["budget"]:
        x = b["mean_run_s"]
        assert x <= t
        assert b["test_wait_budget_s"] == pytest.approx(t - x, abs=1e-3)
        assert b["wait_budget_s"] == pytest.approx(
            a - goal["other_run_s"] - goal["test_fraction"] * x, abs=1e-3
        )


def test_save_replaces_the_row(tmp_path, capsys):
    mod = _module()
    path = tmp_path / "out" / "ef.json"
    row = {"workload": "mixed", "batch": 48, "seed": 0, "v": 1}
    mod.save(row, path)
    mod.save({"workload": "ai-coding", "batch": 64, "seed": 1, "v": 2}, path)
    mod.save(row | {"v": 3}, path)
    rows = json.loads(path.read_text())["rows"]
    assert [(r["workload"], r["v"]) for r in rows] == [("ai-coding", 2), ("mixed", 3)]


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--workload", "search"], ["--workload", "ai-coding", "coding+search", "mixed"]),
        (["--batch", "0"], ["--batch", "positive integer"]),
        (["--policies", "tangram,fixed-dop"], ["--policies", "known"]),
    ],
)
def test_bad_arguments_are_refused_by_name(argv, names, capsys):
    mod = _module()
    with pytest.raises(SystemExit) as e:
        mod.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for name in names:
        assert name in err
