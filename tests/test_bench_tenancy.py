"""bench/paper/tenancy.py's burst scenario (issue 34): with A steady at its 50% share (evenly
spaced arrivals, the default) B's burst leaves A's p99 ACT within 20% of A alone; the same
trajectories at Poisson times are reported beside it; an unknown arrival mode is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_loader import load_script

SCRIPT = Path(__file__).parents[1] / "bench" / "paper" / "tenancy.py"


def _module():
    return load_script(SCRIPT, "tenancy_under_test")


def test_burst_seed_0_steady_meets_the_goal_poisson_beside(capsys):
    mod = _module()
    mod.main(["--burst-seeds", "0", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["a_arrivals"] == "even"
    (row,) = doc["burst_seeds"]
    assert (row["scenario"], row["a_arrivals"], row["seed"]) == ("burst", "even", 0)
    assert abs(row["a_load_burst"] - 0.5) < 0.01  # steady at its share
    assert row["b_last_start_s"] > 220.0  # B stayed backlogged past its burst
    rise = row["a_p99_fair_s"] / row["a_p99_alone_s"] - 1.0
    assert row["rise_fair"] == pytest.approx(rise, abs=1e-4)
    assert rise <= 0.20 and row["met"] and row["judged"]
    # beside it, the same trajectories at Poisson times: the same calls (alone, none waits),
    # A's load in the burst window a draw, not its share
    drawn = mod.burst(0, full=False, even=False)
    assert drawn["scenario"] == "burst_poisson" and drawn["a_arrivals"] == "poisson"
    assert not drawn["judged"]
    assert drawn["a_p99_alone_s"] == row["a_p99_alone_s"]
    assert abs(drawn["a_load_burst"] - 0.5) > 0.01


def test_unknown_arrivals_are_refused(capsys):
    mod = _module()
    with pytest.raises(SystemExit) as e:
        mod.main(["--burst-seeds", "0", "--arrivals", "bursty"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--arrivals" in err and "even" in err and "poisson" in err
