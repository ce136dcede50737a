"""bench/paper/fig9.py --tally: the counts agree with the simulated rows they are made of."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

FIG9 = Path(__file__).parents[1] / "bench" / "paper" / "fig9.py"


def _fig9():
    sys.path.insert(0, str(FIG9.parent))  # fig9 imports its sibling common.py
    try:
        spec = importlib.util.spec_from_file_location("fig9_under_test", FIG9)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(FIG9.parent))


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
