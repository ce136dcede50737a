"""bench/cluster.py --nodes: the coordinator at scale, run small (4 nodes, a 1 s window).

The real size (128 nodes, a 30 s window) is a benchmark run by hand, not a test; this runs
the same code end to end: a real coordinator process, lightweight nodes of the real node
code joining it over TLS, a real ``tangramd node`` and ``tangramd up`` for the execs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "cluster.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120
    )


def test_scale_mode_reports_storm_heartbeats_and_execs() -> None:
    done = _run("--nodes", "4", "--window", "1", "--acts", "12", "--rounds", "2", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)["e_scale"]
    assert out["nodes"] == 4 and out["heartbeat_s"] == 1.0
    assert isinstance(out["core_compiled"], bool)
    storm = out["join_storm"]
    assert storm["nodes"] == 4
    assert 0 < storm["to_welcome"]["p50_ms"] <= storm["to_welcome"]["p99_ms"]
    assert storm["to_welcome"]["p99_ms"] <= storm["max_to_welcome_ms"] < 60_000
    assert storm["all_ready_s"] * 1e3 >= storm["max_to_welcome_ms"] - 1
    beats = out["heartbeats"]
    assert beats["window_s"] == 1.0 and beats["goal_cores"] == 1.0
    assert 0 <= beats["coordinator_cores"] < 2.0  # a 2-core host at most
    assert isinstance(beats["meets_goal"], bool)
    ex = out["exec"]
    assert ex["heartbeating_nodes"] == 3 and ex["nodes_ready_at_end"] == 4
    assert ex["actions_per_side"] == 12
    for side in ("tangramd_up", "through_node"):
        assert 0 < ex[side]["p50_ms"] <= ex[side]["p99_ms"]
    assert ex["hop_p99_ms"] == round(ex["through_node"]["p99_ms"] - ex["tangramd_up"]["p99_ms"], 3)
    assert ex["goal_hop_p99_ms"] == 2.0 and isinstance(ex["meets_goal"], bool)
    assert ex["sequential_execs_per_s"]["node"] > 0
    assert ex["concurrent_execs_per_s"]["clients"] == 8
    assert ex["concurrent_execs_per_s"]["node"] > 0
    assert ex["coordinator_cpu_ms_per_exec"] >= 0  # (10 ms clock ticks)
    alone = ex["alone"]  # the control: the same daemons once the others have left
    assert set(alone) == {
        "tangramd_up",
        "through_node",
        "hop_p50_ms",
        "hop_p99_ms",
        "coordinator_cpu_ms_per_exec",
    }
    assert alone["hop_p50_ms"] == round(
        alone["through_node"]["p50_ms"] - alone["tangramd_up"]["p50_ms"], 3
    )


def test_scale_mode_refuses_bad_sizes() -> None:
    done = _run("--nodes", "1")
    assert done.returncode == 2
    assert "--nodes: at least 2" in done.stderr and "got 1" in done.stderr
    done = _run("--nodes", "4", "--window", "0")
    assert done.returncode == 2 and "--window: a positive number of seconds" in done.stderr
