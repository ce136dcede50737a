"""The main job (`scripts/demo.sh` runs `examples/rollout.py`), small, on a real daemon."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from script_loader import load_script

from tangram import AsyncClient, Client
from tangram.testing import SpawnedDaemon, wait_for_async

REPO = Path(__file__).resolve().parents[1]
MIN_SPEEDUP = 1.15  # examples/rollout.py: a second core is taken only where it pays this


def _rollout() -> ModuleType:
    return load_script(REPO / "examples" / "rollout.py", "rollout")


def test_the_demo_drives_a_rollout_and_reports_honestly_where_its_logs_are() -> None:
    """A small rollout (2 crowded trajectories, 1 tail one, 1 tool/API step each, a short
    reward suite) through the `tangramd up` the demo starts: every action ends `ok`; the
    profile is saved as elastic exactly when the measured speed-up at 2 cores pays; a
    reward run gets 2 cores only when it is, and then the tail's lone run does (the
    crowd's runs are still in the load window, but their environments are gone); and the
    daemon's log path and how to remove the demo's files are printed after the summary, the
    log being there."""
    args = ["--trajectories", "2", "--tail", "1", "--steps", "1", "--scale", "0.3", "--json"]
    proc = subprocess.run(  # one stream, as a terminal shows it: the order is checked
        [sys.executable, str(REPO / "examples" / "rollout.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-2000:]
    start = out.index("\n{\n") + 1  # the summary (indented JSON) between progress lines
    end = out.index("\n}\n", start) + 2
    report = json.loads(out[start:end])
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
        assert isinstance(report["waits"], dict)  # explained where a queue p99 reached 1 s
        assert all(w["waited_in_s"] for w in report["waits"].values()), report["waits"]
        assert log.is_file() and log.stat().st_size > 0
        assert out.index(f"its log: {log}") > end
        assert out.index(f"rm -rf {log.parent}") > end
    finally:
        shutil.rmtree(log.parent, ignore_errors=True)


def test_the_demo_explains_a_long_wait_by_the_resource_it_waited_for(
    daemon: SpawnedDaemon,
) -> None:
    """A one-core command submitted while a command holds every core of a real daemon
    waits: the demo's explanation (the daemon's story of the wait, the results for what
    held the resource) says it was queued for the cores and that the other command held
    all of them meanwhile; a kind that did not wait is not explained."""
    rollout = _rollout()
    with Client(daemon.socket) as c:
        pools = c.status()["pools"]
    cpu = next(name for name in pools if name.startswith("cpu:"))
    cores = pools[cpu]["capacity"]
    rows: list[dict[str, Any]] = []

    async def contend() -> None:
        async with AsyncClient(daemon.socket) as c:
            env = await c.env_open()

            async def hog() -> None:
                t0 = time.monotonic()
                r = await c.exec(["sleep", "1.5"], env=env, cpus=cores)
                rows.append(rollout.exec_row("x", "hog", t0, r))

            async def hog_running() -> bool:
                queue = await c.queue()
                return any(a["kind"] == "exec" for a in queue["running"])

            hogging = asyncio.ensure_future(hog())
            await wait_for_async(hog_running, 30, "the hog running on every core")
            t0 = time.monotonic()
            r = await c.exec(["true"], env=env, cpus=1)
            rows.append(rollout.exec_row("x", "short", t0, r))
            await hogging
            await c.env_close(env)

    asyncio.run(contend())
    assert [r["outcome"] for r in rows] == ["ok", "ok"], rows
    short = next(r for r in rows if r["kind"] == "short")
    assert short["queue_s"] > 0.5, rows  # it could not start before the hog ended
    with Client(daemon.socket) as c:
        waits = rollout.explain_waits(c, rows, {cpu: cores}, min_wait_s=0.5)
    assert set(waits) == {"x/short"}, waits
    why = waits["x/short"]
    label = f"queued for cores ({cpu})"
    assert max(why["waited_in_s"], key=why["waited_in_s"].get) == label, why
    assert why["waited_in_s"][label] >= 0.9 * short["queue_s"], (why, short)
    assert why["pool"] == cpu and why["capacity"] == cores
    assert why["held_meanwhile"]["x/hog"] >= 0.9 * cores, why  # it held them all
    assert why["placed_meanwhile"] == {}, why
    (line,) = rollout.wait_lines(waits)
    assert line.startswith(f"x/short: its wait ({short['queue_s']:.1f} s) was 100% {label}"), line
    held = f"the {cores} cores were held by x/hog ({why['held_meanwhile']['x/hog']:.2f} on average)"
    assert held in line, line
