"""A real AI-coding mini-experiment on this machine: tangram AOE vs pod-per-trajectory.

    python bench/ai_coding_real.py [--trajectories 8] [--steps 4] [--pod-cores 1] [--json]

Both policies run the same K trajectories (same seeds) in Docker containers of the test
image: each trajectory alternates think time (standing in for LLM generation) with short
shell commands, then runs an elastic pytest reward (the bundled CPU-bound suite).

- tangram: ``tangramd up --cpu-backend docker``; every trajectory has its own container from
  its first action, holding no cores between actions; each action gets cores on execution
  (the reward gets 1 or 2 cores as the scheduler decides from the suite's profile).
- baseline: what a Kubernetes pod does: a trajectory's container holds ``--pod-cores`` cores
  (cpuset + quota) for its whole life; pods wait FCFS when the node has no room; actions run
  with ``docker exec``; pytest gets ``-n <pod cores>``.

ACT of an action = from the moment the trajectory wants to run it to its completion, so the
first action of a trajectory includes environment (pod) start-up and any wait for a pod.
Reports avg and p99 ACT (all actions, tool actions, reward actions) and total time for both,
and the ratio. Needs dockerd and the test image (.ci/docker-setup.sh).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tangram import AsyncClient, Client  # noqa: E402
from tangram.testing import spawn_daemon  # noqa: E402
from tangramd.backends.base import rewrite_pytest  # noqa: E402

IMAGE = "tangram-test:bookworm"
SUITE = ROOT / "tests" / "data" / "cpu_suite"
TOOLS = [
    "ls -la /work",
    "cat /work/suite/pytest.ini",
    "python3 -c 'print(sum(i * i for i in range(300000)))'",
    "grep -c def /work/suite/cpu_burn.py",
    "echo patch >> /work/notes.txt && wc -l /work/notes.txt",
]


def setup_cmd() -> str:
    """First action: the 'agent' writes the repository (the test suite) into its sandbox."""
    parts = ["mkdir -p /work/suite"]
    for name in ("cpu_burn.py", "pytest.ini"):
        b64 = base64.b64encode((SUITE / name).read_bytes()).decode()
        parts.append(f"echo {b64} | base64 -d > /work/suite/{name}")
    return " && ".join(parts)


def reward_cmd() -> str:
    return "cd /work/suite && python3 -m pytest -q -p no:cacheprovider"


def plan(k: int, steps: int, seed: int) -> list[tuple[float, str, str]]:
    """(think seconds, kind, command) for trajectory k: setup, tools, reward."""
    rng = random.Random(seed * 7919 + k)
    out = [(rng.uniform(0.1, 0.4), "tool", setup_cmd())]
    for _ in range(steps):
        out.append((rng.uniform(0.3, 1.0), "tool", rng.choice(TOOLS)))
    out.append((rng.uniform(0.3, 1.0), "reward", reward_cmd()))
    return out


# ------------------------------------------------------------------------------ tangram


async def run_tangram(k: int, steps: int, seed: int, scale: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tangram-aicoding-") as tmp:
        d = spawn_daemon(tmp, "[sched]\ncoalesce_ms = 1.0\n", "--cpu-backend", "docker")
        try:
            _profile(d.socket, scale)
            rows: list[dict[str, Any]] = []
            t0 = time.monotonic()
            async with AsyncClient(d.socket) as c:
                await asyncio.gather(
                    *(_tangram_traj(c, i, steps, seed, scale, rows) for i in range(k))
                )
            total = time.monotonic() - t0
        finally:
            d.stop()
    return {"rows": rows, "total_s": total}


def _profile(sock: str, scale: str) -> None:
    """Profile the reward at 1 and 2 cores in a container (what `tangramctl profile` does)."""
    with Client(sock) as c:
        env = c.env_open(image=IMAGE)
        c.exec(setup_cmd(), env=env)
        dop = {}
        for n in (1, 2):
            r = c.exec(reward_cmd(), env=env, cpus=n, env_vars={"CPU_SUITE_SCALE": scale})
            assert r.outcome == "ok", r
            dop[str(n)] = r.exec_s
        c.env_close(env)
        speed = {n: dop["1"] / s for n, s in dop.items()}
        eff = {n: min(1.0, sp / int(n)) for n, sp in speed.items()}
        c.profile_save("reward", dop=dop, t1_s=dop["1"], eff=eff, speedup=speed, elastic=True)


async def _tangram_traj(
    c: AsyncClient, k: int, steps: int, seed: int, scale: str, rows: list[dict[str, Any]]
) -> None:
    env = None
    for i, (think, kind, cmd) in enumerate(plan(k, steps, seed)):
        await asyncio.sleep(think)
        t0 = time.monotonic()
        if env is None:
            env = await c.env_open(image=IMAGE, trajectory=f"t{k}")
        if kind == "reward":
            r = await c.exec(cmd, env=env, profile="reward", env_vars={"CPU_SUITE_SCALE": scale})
        else:
            r = await c.exec(cmd, env=env, cpus=1)
        rows.append(
            {
                "kind": kind,
                "act_s": time.monotonic() - t0,
                "outcome": r.outcome,
                "cores": len(r.cores),
                "first": i == 0,
            }
        )
    if env is not None:
        await c.env_close(env)


# ------------------------------------------------------------------------------ baseline


async def run_baseline(
    k: int, steps: int, seed: int, scale: str, pod_cores: int, host_cores: list[int]
) -> dict[str, Any]:
    import docker

    client = docker.from_env()
    slots: asyncio.Queue[tuple[int, ...]] = asyncio.Queue()
    for i in range(len(host_cores) // pod_cores):
        slots.put_nowait(tuple(host_cores[i * pod_cores : (i + 1) * pod_cores]))
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    await asyncio.gather(*(_pod_traj(client, slots, i, steps, seed, scale, rows) for i in range(k)))
    return {"rows": rows, "total_s": time.monotonic() - t0}


async def _pod_traj(
    client: Any,
    slots: asyncio.Queue[tuple[int, ...]],
    k: int,
    steps: int,
    seed: int,
    scale: str,
    rows: list[dict[str, Any]],
) -> None:
    ctr = None
    cores: tuple[int, ...] = ()
    try:
        for i, (think, kind, cmd) in enumerate(plan(k, steps, seed)):
            await asyncio.sleep(think)
            t0 = time.monotonic()
            if ctr is None:  # pod scheduling (FCFS on free core slots) + pod start
                cores = await slots.get()
                ctr = await asyncio.to_thread(
                    client.containers.run,
                    IMAGE,
                    ["sleep", "infinity"],
                    detach=True,
                    network_mode="none",
                    init=True,
                    labels={"org.arl-tangram.bench": "pod"},
                    cpuset_cpus=",".join(map(str, cores)),
                    cpu_period=100000,
                    cpu_quota=100000 * len(cores),
                )
            full = rewrite_pytest(cmd, len(cores), True)
            code, _ = await asyncio.to_thread(
                ctr.exec_run,
                ["/bin/sh", "-c", full],
                environment={"CPU_SUITE_SCALE": scale, "TANGRAM_CPUS": str(len(cores))},
            )
            rows.append(
                {
                    "kind": kind,
                    "act_s": time.monotonic() - t0,
                    "outcome": "ok" if code == 0 else "failed",
                    "cores": len(cores),
                    "first": i == 0,
                }
            )
    finally:
        if ctr is not None:
            await asyncio.to_thread(ctr.remove, force=True)
            slots.put_nowait(cores)


# ------------------------------------------------------------------------------ report


def summary(rows: list[dict[str, Any]], total_s: float) -> dict[str, Any]:
    def act(sel: list[dict[str, Any]]) -> dict[str, float]:
        v = sorted(r["act_s"] for r in sel)
        return {
            "avg_s": round(statistics.fmean(v), 3),
            "p50_s": round(statistics.median(v), 3),
            "p99_s": round(v[min(len(v) - 1, int(0.99 * len(v)))], 3),
        }

    return {
        "total_s": round(total_s, 2),
        "actions": len(rows),
        "failed": sum(r["outcome"] != "ok" for r in rows),
        "act": act(rows),
        "tool_act": act([r for r in rows if r["kind"] == "tool"]),
        "reward_act": act([r for r in rows if r["kind"] == "reward"]),
        "reward_cores": sorted({r["cores"] for r in rows if r["kind"] == "reward"}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--pod-cores", type=int, default=1)
    ap.add_argument("--scale", default="0.5", help="reward suite work (1.0 ≈ 4 s on one core)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import os

    host_cores = sorted(os.sched_getaffinity(0))
    t = asyncio.run(run_tangram(args.trajectories, args.steps, args.seed, args.scale))
    b = asyncio.run(
        run_baseline(
            args.trajectories, args.steps, args.seed, args.scale, args.pod_cores, host_cores
        )
    )
    res = {
        "trajectories": args.trajectories,
        "steps": args.steps,
        "pod_cores": args.pod_cores,
        "host_cores": len(host_cores),
        "tangram": summary(t["rows"], t["total_s"]),
        "baseline_pod_per_trajectory": summary(b["rows"], b["total_s"]),
    }
    tb, bb = res["tangram"], res["baseline_pod_per_trajectory"]
    res["avg_act_ratio"] = round(tb["act"]["avg_s"] / bb["act"]["avg_s"], 3)
    res["p99_act_ratio"] = round(tb["act"]["p99_s"] / bb["act"]["p99_s"], 3)
    res["total_time_ratio"] = round(tb["total_s"] / bb["total_s"], 3)
    print(json.dumps(res) if args.json else json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
