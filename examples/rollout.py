"""The main job: start ``tangramd up`` and drive an agentic-RL-like rollout through it.

    python examples/rollout.py [--trajectories 24] [--steps 4] [--socket PATH] [--json]

Each trajectory opens an environment (state persists between its actions), then alternates a
think time standing in for LLM generation with real actions: short shell commands (tool
calls), rate-limited API calls under a lease, and at the end an *elastic* reward run of a
bundled CPU-bound pytest suite. The suite is profiled first (``-n 1`` vs ``-n 2`` on pinned
cores) so the scheduler knows how it scales. At the end it prints, per action kind, queue
time, execution time and ACT (action completion time = queue + execution).

Without ``--socket`` it starts its own ``tangramd up`` on a temporary socket and stops it
with SIGTERM at the end; with ``--socket`` it uses a daemon that is already running.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tangram import AsyncClient, Client  # noqa: E402
from tangram.testing import spawn_daemon  # noqa: E402

SUITE = ROOT / "tests" / "data" / "cpu_suite"
CONFIG = """
[sched]
coalesce_ms = 1.0

[cpu]
default_env_mem = "256MiB"

[[api]]
name = "search"     # a rate-limited web API: 4 calls at once, 40 per second
concurrency = 4
quota = 40
period_s = 1.0
overflow = "wait"
ttl_s = 10
"""

TOOL_COMMANDS = [
    "ls -la",
    "echo 'def solve(x):\n    return x * 2' > solution.py && cat solution.py",
    "grep -c def solution.py || true",
    f"{sys.executable} -c 'print(sum(i * i for i in range(200000)))'",
    "wc -c solution.py 2>/dev/null || echo missing",
    "true",
]


def reward_cmd() -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(SUITE)]


def profile_suite(sock: str, scale: str) -> dict[str, Any]:
    """Profile the reward suite at DoP 1 and 2 and save it (what `tangramctl profile` does)."""
    with Client(sock) as c:
        env = c.env_open()
        dop: dict[str, float] = {}
        for k in (1, 2):
            r = c.exec(reward_cmd(), env=env, cpus=k, env_vars={"CPU_SUITE_SCALE": scale})
            if r.outcome != "ok":
                sys.exit(f"reward suite failed at -n {k}: {r.stdout[-500:]}{r.stderr[-500:]}")
            dop[str(k)] = r.exec_s
        c.env_close(env)
        t1 = dop["1"]
        speedup = {k: t1 / v for k, v in dop.items()}
        eff = {k: min(1.0, s / int(k)) for k, s in speedup.items()}
        c.profile_save("reward-suite", dop=dop, t1_s=t1, eff=eff, speedup=speedup, elastic=True)
    return {"dop": dop, "speedup": speedup}


async def trajectory(
    c: AsyncClient,
    k: int,
    steps: int,
    scale: str,
    rng: random.Random,
    rows: list[dict[str, Any]],
    progress: list[int],
) -> None:
    env = await c.env_open(trajectory=f"traj-{k}")
    try:
        for _ in range(steps):
            await asyncio.sleep(rng.uniform(0.05, 0.4))  # LLM generation ("think time")
            if rng.random() < 0.3:
                t0 = time.monotonic()
                async with c.lease("search"):
                    granted = time.monotonic()
                    await asyncio.sleep(rng.uniform(0.02, 0.08))  # the API call itself
                rows.append(
                    {
                        "kind": "api",
                        "outcome": "ok",
                        "queue_s": granted - t0,
                        "exec_s": time.monotonic() - granted,
                    }
                )
            else:
                r = await c.exec(rng.choice(TOOL_COMMANDS), env=env, cpus=1)
                rows.append(
                    {"kind": "tool", "outcome": r.outcome, "queue_s": r.queue_s, "exec_s": r.exec_s}
                )
        await asyncio.sleep(rng.uniform(0.05, 0.4))
        r = await c.exec(
            reward_cmd(), env=env, profile="reward-suite", env_vars={"CPU_SUITE_SCALE": scale}
        )
        rows.append(
            {
                "kind": "reward",
                "outcome": r.outcome,
                "queue_s": r.queue_s,
                "exec_s": r.exec_s,
                "cores": len(r.cores),
            }
        )
        if r.outcome != "ok":
            print(
                f"\nreward run of traj-{k} ended {r.outcome}:\n{r.stdout[-800:]}{r.stderr[-800:]}",
                file=sys.stderr,
            )
    finally:
        await c.env_close(env)
        progress[0] += 1
        print(f"\r  trajectories done: {progress[0]}", end="", file=sys.stderr, flush=True)


async def rollout(sock: str, n: int, steps: int, scale: str, seed: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    progress = [0]
    async with AsyncClient(sock) as c:
        await asyncio.gather(
            *(
                trajectory(c, k, steps, scale, random.Random(seed * 1000 + k), rows, progress)
                for k in range(n)
            )
        )
    print(file=sys.stderr)
    return rows


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_kind[r["kind"]].append(r)
    for kind, rs in sorted(by_kind.items()):
        acts = [r["queue_s"] + r["exec_s"] for r in rs]
        outcomes: dict[str, int] = defaultdict(int)
        for r in rs:
            outcomes[r["outcome"]] += 1
        row = {
            "count": len(rs),
            "outcomes": dict(outcomes),
            "queue_p50_s": statistics.median(r["queue_s"] for r in rs),
            "queue_p99_s": pct([r["queue_s"] for r in rs], 0.99),
            "exec_p50_s": statistics.median(r["exec_s"] for r in rs),
            "act_avg_s": statistics.fmean(acts),
            "act_p50_s": statistics.median(acts),
            "act_p99_s": pct(acts, 0.99),
        }
        if kind == "reward":
            row["cores_used"] = dict(sorted(_count(r.get("cores", 0) for r in rs).items()))
        out[kind] = row
    return out


def _count(values: Any) -> dict[int, int]:
    c: dict[int, int] = defaultdict(int)
    for v in values:
        c[v] += 1
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description="Drive an example rollout through tangramd.")
    ap.add_argument("--trajectories", type=int, default=12)
    ap.add_argument("--steps", type=int, default=4, help="tool/API actions per trajectory")
    ap.add_argument("--scale", default="0.5", help="reward suite work per test (1.0 ≈ 4 s)")
    ap.add_argument("--socket", default=None, help="use a running daemon instead of starting one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="tangram-demo-"))
    daemon = None
    if args.socket:
        sock = args.socket
    else:
        print(f"starting tangramd up (socket {tmp / 'tangramd.sock'}) ...", file=sys.stderr)
        daemon = spawn_daemon(tmp, CONFIG)
        sock = daemon.socket
    try:
        with Client(sock) as c:
            st = c.status()
            cores = st["pools"]["cpu:local"]["capacity"] if "cpu:local" in st["pools"] else "?"
        print(f"daemon up: backend={st['backend']} cores={cores}", file=sys.stderr)
        print("profiling the reward suite at -n 1 and -n 2 ...", file=sys.stderr)
        prof = profile_suite(sock, args.scale)
        print(
            f"  T(1)={prof['dop']['1']:.2f}s T(2)={prof['dop']['2']:.2f}s "
            f"speedup(2)={prof['speedup']['2']:.2f}",
            file=sys.stderr,
        )
        print(
            f"running {args.trajectories} trajectories x {args.steps} actions + reward ...",
            file=sys.stderr,
        )
        t0 = time.monotonic()
        rows = asyncio.run(rollout(sock, args.trajectories, args.steps, args.scale, args.seed))
        wall = time.monotonic() - t0
        with Client(sock) as c:
            passes = c.status()["passes"]
    finally:
        if daemon is not None:
            code = daemon.stop()
            print(f"tangramd stopped (exit {code})", file=sys.stderr)
    summary = {
        "wall_s": wall,
        "actions": len(rows),
        "scheduler_passes": passes,
        "profile": prof,
        "kinds": summarise(rows),
    }
    if args.json:
        print(json.dumps(summary, indent=1))
        return
    print(
        f"\n{len(rows)} actions from {args.trajectories} trajectories in {wall:.1f} s "
        f"({passes} scheduling passes)\n"
    )
    head = (
        f"{'kind':<8}{'count':>6}{'queue p50':>11}{'queue p99':>11}{'exec p50':>10}"
        f"{'ACT avg':>9}{'ACT p99':>9}  outcomes"
    )
    print(head)
    print("-" * len(head))
    for kind, r in summary["kinds"].items():
        outcomes = " ".join(f"{k}={v}" for k, v in r["outcomes"].items())
        extra = f"  cores={r['cores_used']}" if "cores_used" in r else ""
        print(
            f"{kind:<8}{r['count']:>6}{r['queue_p50_s']:>10.3f}s{r['queue_p99_s']:>10.3f}s"
            f"{r['exec_p50_s']:>9.3f}s{r['act_avg_s']:>8.3f}s{r['act_p99_s']:>8.3f}s  "
            f"{outcomes}{extra}"
        )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
