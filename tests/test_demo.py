"""The main job (`scripts/demo.sh` runs `examples/rollout.py`), small, on a real daemon."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIN_SPEEDUP = 1.15  # examples/rollout.py: a second core is taken only where it pays this


def test_the_demo_drives_a_rollout_and_reports_honestly_where_its_logs_are() -> None:
    """A small rollout (2 crowded trajectories, 1 tail one, 1 tool/API step each, a short
    reward suite) through the `tangramd up` the demo starts: every action ends `ok`; the
    profile is saved as elastic exactly when the measured speed-up at 2 cores pays; a
    reward run gets 2 cores only when it is, and then the tail's lone run does (the
    crowd's runs are still in the load window, but their environments are gone); and the
    daemon's log path and how to remove
    the demo's files are printed, the log being there."""
    args = ["--trajectories", "2", "--tail", "1", "--steps", "1", "--scale", "0.3", "--json"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "rollout.py"), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    log = Path(report["log"])
    try:
        assert report["actions"] == 3 * 2  # each trajectory: one step, one reward run
        kinds = report["kinds"]
        assert {kind.split("/")[0] for kind in kinds} == {"crowded", "tail"}
        assert all(set(k["outcomes"]) == {"ok"} for k in kinds.values()), kinds
        profile = report["profile"]
        assert profile["elastic"] == (profile["speedup"]["2"] >= MIN_SPEEDUP), profile
        widest = max(int(cores) for kind in kinds.values() for cores in kind.get("cores_used", {}))
        assert widest == 1 or (profile["elastic"] and widest == 2), (profile, kinds)
        if profile["elastic"]:  # the straggler is alone on the node: it takes both cores
            assert kinds["tail/reward"]["cores_used"] == {"2": 1}, (profile, kinds)
        assert log.is_file() and log.stat().st_size > 0
        assert f"its log: {log}" in proc.stderr
        assert f"rm -rf {log.parent}" in proc.stderr
    finally:
        shutil.rmtree(log.parent, ignore_errors=True)
