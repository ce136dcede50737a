"""bench/paper/sim_scale.py's small mode: its JSON describes the run it made, and the
simulated part of it is the same on a second run of the same seed."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_loader import load_script

SCRIPT = Path(__file__).parents[1] / "bench" / "paper" / "sim_scale.py"


def _sim_scale():
    return load_script(SCRIPT, "sim_scale_under_test")


def test_small_mode_json(capsys):
    mod = _sim_scale()
    argv = ["--batch", "192", "--nodes", "2", "--policies", "tangram,k8s", "--json"]
    doc = mod.main(argv)
    assert '"goal_met"' in capsys.readouterr().out  # printed as JSON
    assert (doc["workload"], doc["batch"], doc["cpu_nodes"], doc["cores"]) == (
        "ai-coding",
        192,
        2,
        128,
    )
    assert doc["goal_s"] == 120.0 and isinstance(doc["compiled"], bool)
    assert doc["mem_gb_per_node"] == 512.0
    t, k = doc["policies"]["tangram"], doc["policies"]["k8s"]
    for row in (t, k):
        assert row["finished"] and row["actions"] == doc["trace_actions"] and not row["failed"]
        assert row["wall_s"] > 0 and row["makespan_s"] > 0
        assert 0 < row["avg_act_s"] <= row["p99_act_s"]
    assert t["passes"] > 0 and k["passes"] == 0  # k8s never calls the scheduler
    assert doc["max_wall_s"] == max(t["wall_s"], k["wall_s"])
    assert doc["goal_met"] == (doc["max_wall_s"] <= 120.0)
    again = mod.main(argv)
    timed = ("wall_s", "cpu_s")  # not deterministic
    for name, row in doc["policies"].items():
        assert row["cpu_s"] >= 0
        same = {f: v for f, v in row.items() if f not in timed}
        assert same == {f: v for f, v in again["policies"][name].items() if f not in timed}


def test_scale_cluster_is_four_nodes_per_unit_of_scale():
    mod = _sim_scale()
    (spec,) = mod.scale_cluster(10).cpu_nodes
    assert (spec.count, spec.cores, spec.numa, spec.mem_gb) == (40, 64, 2, 512)
    assert mod.scale_cluster(0.1).cpu_nodes[0].count == 1
    assert mod.scale_cluster(1, 3, 2048).cpu_nodes[0].mem_gb == 2048


def test_cap_stops_a_run_and_says_how_far_it_got():
    mod = _sim_scale()
    doc = mod.main(["--batch", "192", "--nodes", "2", "--policies", "tangram", "--cap-s", "0"])
    row = doc["policies"]["tangram"]
    assert row["finished"] is False and doc["goal_met"] is False
    assert row["simulated_s"] > 0 and 0 <= row["trajectories_done"] < row["trajectories"] == 192
    assert row["passes"] > 0


def test_both_pass_modes_side_by_side():
    mod = _sim_scale()
    argv = ["--batch", "256", "--nodes", "2", "--mem-gb", "64", "--policies", "tangram"]
    doc = mod.main([*argv, "--passes", "all,touched"])
    assert doc["passes"] == ["all", "touched"]
    every, touched = doc["policies"]["tangram@all"], doc["policies"]["tangram@touched"]
    assert every["finished"] and touched["finished"]
    assert every["actions"] == touched["actions"] == doc["trace_actions"]
    ratios = doc["touched_vs_all"]["tangram"]
    assert ratios["avg_act_s"] == round(touched["avg_act_s"] / every["avg_act_s"], 4)
    assert ratios["passes"] == round(touched["passes"] / every["passes"], 4)
    assert set(doc["goal_met_by_passes"]) == {"all", "touched"}
    with pytest.raises(SystemExit):
        mod.main([*argv, "--passes", "all,some"])
