"""bench/paper/fig9.py --tally: the counts agree with the simulated rows they are made of."""

from __future__ import annotations

import math
from pathlib import Path

from script_loader import load_script

FIG9 = Path(__file__).parents[1] / "bench" / "paper" / "fig9.py"


def _fig9():
    return load_script(FIG9, "fig9_under_test")


def test_tally_counts_the_simulated_rows():
    """Two real simulated rows (mixed cluster, batch 64, seeds 0 and 1) against fixed DoP 8
    and 16: each count is what the rows' own summaries say, and a file's non-row keys are
    skipped."""
    fig9 = _fig9()
    rows = {}
    for seed in (0, 1):
        (wl, b, s), res = fig9._one(
            ("mixed", "coding+search", 64, seed, ("tangram", "fixed-dop:8", "fixed-dop:16"))
        )
        rows[f"{wl}/{b}/seed{s}"] = res
    rows["wall_s"] = 1.0  # save() adds one to every output file
    (out,) = fig9.tally(rows)
    assert (out["workload"], out["batch"], out["rows"]) == ("coding+search", 64, 2)
    avg_le = p99_le = both = 0
    ratios = []
    for res in (r for k, r in rows.items() if k != "wall_s"):
        best = min(("fixed-dop:8", "fixed-dop:16"), key=lambda p: res[p]["avg_act_s"])
        t, f = res["tangram"], res[best]
        a, p = t["avg_act_s"] <= f["avg_act_s"], t["p99_act_s"] <= f["p99_act_s"]
        avg_le, p99_le, both = avg_le + a, p99_le + p, both + (a and p)
        ratios.append(t["p99_act_s"] / f["p99_act_s"])
    assert (out["avg_le"], out["p99_le"], out["both"]) == (avg_le, p99_le, both)
    assert out["worst_p99"] == round(max(ratios), 3)
    assert out["geo_p99"] == round(math.sqrt(ratios[0] * ratios[1]), 3)
    # one-sided sign test: P(at least p99_le wins of 2 fair coins)
    assert out["sign_p"] == {0: 1.0, 1: 0.75, 2: 0.25}[p99_le]


def test_per_kind_rows_and_oracle():
    """One real row (mixed cluster, coding+search, batch 64): the kinds partition the
    actions, the oracle (each test run at its best run) is at most every run's test-run
    mean and at least the floor, and each kind's best fixed DoP is that kind's least."""
    fig9 = _fig9()
    fig9.FIXED = ("fixed-dop:8", "fixed-dop:16")
    key, res = fig9._one(
        ("mixed", "coding+search", 64, 0, ("tangram", "fixed-dop:8", "fixed-dop:16"))
    )
    runs = ("tangram", "fixed-dop:8", "fixed-dop:16")
    for p in runs:
        kinds = res[p]["by_kind"]
        assert set(kinds) == {"tool", "test", "api", "gpu"}
        assert sum(k["actions"] for k in kinds.values()) == res[p]["actions"]
        # one test run per coding trajectory, one judge call per search trajectory
        assert kinds["test"]["actions"] == kinds["gpu"]["actions"] == 64
    o = res["oracle"]
    assert o["test_runs"] == 64 and sum(o["chosen"].values()) == 64
    assert o["test_avg_act_s"] <= min(res[p]["by_kind"]["test"]["avg_act_s"] for p in runs)
    assert 0 < o["test_floor_s"] <= o["test_avg_act_s"]
    rows = {r["kind"]: r for r in fig9.per_kind([(key, res)])}
    assert set(rows) == {"all", "tool", "test", "api", "gpu"}
    for kind, r in rows.items():
        of = (lambda p: res[p]) if kind == "all" else (lambda p: res[p]["by_kind"][kind])  # noqa: B023
        best = min(fig9.FIXED, key=lambda p: of(p)["avg_act_s"])
        assert r["best_fixed"] == int(best.split(":")[1])
        ok = of("tangram")["avg_act_s"] <= of(best)["avg_act_s"]
        if kind == "all":
            ok = ok and of("tangram")["p99_act_s"] <= of(best)["p99_act_s"]
        assert r["ok"] is ok
    assert rows["test"]["oracle"] == o["test_avg_act_s"]
