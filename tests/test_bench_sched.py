"""bench/sched.py: the 10x cases, the cost curves and their plot, run small.

The real sizes (65,536 queued on 16,384 cores) take seconds a pass interpreted: only the
slow-marked test runs them; the others run the same code on tiny snapshots.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from script_loader import load_script

from tangram.sched import SchedConfig

BENCH = Path(__file__).resolve().parents[1] / "bench" / "sched.py"
bench = load_script(BENCH, "bench_sched")

ROW = {"queued", "units", "nodes", "p50_ms", "p99_ms", "placed", "passes", "assign_p50_ms"}


def test_scale_cases_are_rows_of_the_same_cases_list() -> None:
    plain = bench.run(3, "fcfs", cases=[(64, 64)])
    assert [(c["queued"], c["units"]) for c in plain["cases"]] == [(64, 64)]
    assert "curves" not in plain  # the default run is today's: no big cases, no curves
    scaled = bench.run(
        3, "fcfs", scale=True, scale_repeat=2, cases=[(64, 64)], scale_cases=[(512, 128, 4)]
    )
    first, big = scaled["cases"]
    assert set(first) >= ROW and set(big) >= ROW
    assert (big["queued"], big["units"], big["nodes"], big["passes"]) == (512, 128, 4, 2)
    assert 0 < big["p50_ms"] <= big["p99_ms"]
    assert 0 < big["placed"] <= 128  # one core at least each, on 128 free cores
    assert first["goal_p99_ms"] == 1.0 and isinstance(first["meets_goal"], bool)
    assert "goal_p99_ms" not in big  # no goal for a size the issue did not set
    assert bench.GOALS[bench.SCALE_CASES[0]] == 50.0
    assert bench.GOALS[bench.SCALE_CASES[1]] == 200.0
    assert bench.SCALE_CASES[1] == (65536, 16384, 128)


def test_scale_case_builds_the_cluster_it_names() -> None:
    snap = bench.build(256, 1024, nodes=8)
    cpus = [p for pid, p in snap.pools.items() if pid.startswith("cpu:")]
    assert len(cpus) == 8 and {p.capacity for p in cpus} == {128}
    assert len(snap.waiting) == 256
    # without nodes: nodes of up to 256 cores, as before
    assert sum(pid.startswith("cpu:") for pid in bench.build(64, 1024).pools) == 4


@pytest.mark.parametrize(
    ("f", "k"),
    [(lambda x: 3.0 * x, 1.0), (lambda x: 0.01 * x * x, 2.0), (lambda x: x * math.log(x), 1.1)],
)
def test_slope_is_the_exponent_on_log_log(f, k) -> None:
    xs = [1024.0 * 2**i for i in range(7)]
    assert bench.slope(xs, [f(x) for x in xs]) == pytest.approx(k, abs=0.05)


def test_curves_and_their_plot(tmp_path: Path) -> None:
    spec = {"queue": [64, 128, 256], "cores": [64, 128], "units": 256, "node_cores": 64,
            "queued": 128}  # fmt: skip
    result = bench.run(
        2, "fcfs", cpu_time=True, scale_repeat=2, with_curves=True, cases=[(64, 64)],
        curve_spec=spec,
    )  # fmt: skip
    by_queue, by_units = result["curves"]["queued"], result["curves"]["units"]
    assert [r["queued"] for r in by_queue["points"]] == [64, 128, 256]
    assert {(r["units"], r["nodes"]) for r in by_queue["points"]} == {(256, 4)}
    assert [(r["units"], r["nodes"]) for r in by_units["points"]] == [(64, 1), (128, 2)]
    assert {r["queued"] for r in by_units["points"]} == {128}
    assert by_queue["fixed"] == {"units": 256, "nodes": 4}
    assert by_units["fixed"] == {"queued": 128, "node_cores": 64}
    for c in (by_queue, by_units):
        for key in ("slope_p50_ms", "slope_p50_ms_upper", "slope_assign_p50_ms"):
            assert math.isfinite(c[key])
        for r in c["points"]:
            assert r["assign_p50_ms"] >= 0 and r["p50_ms"] > 0
    assert result["clock"] == "thread_cpu"
    out = tmp_path / "curve.png"
    bench.plot(result, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    both = tmp_path / "both.png"  # another run's curves beside (docs/img/sched-scale.png)
    bench.plot(result, str(both), before=result, label="again")
    assert both.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_repeat_is_refused_by_name() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--scale", "--scale-repeat", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert "--scale-repeat must be >= 1, got 0" in out.stderr


def test_node_choice_phase_is_the_pass_s_own() -> None:
    """The phase the bench times on its own is what the pass runs: the same nodes chosen
    for the actions the pass gives a node (its new_node placements)."""
    snap = bench.build(512, 256, nodes=4)
    cfg = SchedConfig()
    assigned, never = bench._assign_nodes(bench._unplaced(snap), snap, 0.0, cfg)
    node_of = {a.id: pid for a, pid in assigned}
    d = bench.schedule(snap, 0.0, cfg)
    new = [p for p in d.placements if p.new_node]
    assert new and not never
    assert all(node_of[p.action_id] == p.pool_id for p in new)


@pytest.mark.slow
def test_scale_run_at_full_size() -> None:
    """The real --scale --json run: the two 10x rows, after today's four."""
    out = subprocess.run(
        [sys.executable, str(BENCH), "--scale", "--json", "--cpu-time", "--repeat", "4",
         "--scale-repeat", "1"],
        capture_output=True, text=True, timeout=900, check=True,
    )  # fmt: skip
    rows = json.loads(out.stdout)["cases"]
    assert [(r["queued"], r["units"], r["nodes"]) for r in rows[-2:]] == [
        (16384, 4096, 16),
        (65536, 16384, 128),
    ]
    assert [(r["queued"], r["units"]) for r in rows[:4]] == bench.CASES
    assert all(r["placed"] > 0 and r["p50_ms"] > 0 for r in rows), rows


def test_steady_pass_follows_one_event_in_the_steady_state() -> None:
    """--scale rows also time the pass after one finish in the queue's steady state: every
    pool full or blocked (a pass there places nothing), then one action's cores return."""
    cfg = SchedConfig()
    snap = bench.build(512, 256, nodes=4)
    sat, where = bench.saturate(snap, cfg)
    assert where and len(sat.waiting) < 512
    assert not bench.schedule(sat, 0.0, cfg).placements  # the steady state
    free = {pid: p.free_units() for pid, p in sat.pools.items()}
    row = bench.measure_steady(sat, where, 3, cfg, bench.time.perf_counter)
    assert {pid: p.free_units() for pid, p in sat.pools.items()} == free  # each event undone
    assert row["steady_queued"] == len(sat.waiting)
    assert 0 < row["steady_p50_ms"] <= row["steady_p99_ms"] and row["steady_placed"] >= 1
    scaled = bench.run(1, "fcfs", scale=True, scale_repeat=2, cases=[], scale_cases=[(512, 128, 4)])
    assert {"steady_p50_ms", "steady_p99_ms", "steady_queued"} <= set(scaled["cases"][0])
