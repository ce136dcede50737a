"""The main job: start ``tangramd up`` and drive an agentic-RL-like rollout through it.

    python examples/rollout.py [--trajectories 6] [--tail 2] [--steps 4] [--scale 3.0]
                               [--socket PATH] [--json]

Each trajectory opens an environment (state persists between its actions), then alternates a
think time standing in for LLM generation with real actions: short shell commands (tool
calls), rate-limited API calls under a lease, and at the end an *elastic* reward run of a
bundled CPU-bound pytest suite. The suite is profiled first (``-n 1`` vs ``-n 2`` on pinned
cores, best of ``--repeat`` runs) so the scheduler knows how it scales.

Two phases show elasticity honestly on a small (2-core) host:

- *crowded*: ``--trajectories`` run at once; cores are scarce, so reward runs mostly get
  one core each (a second core would delay someone else more than it helps);
- *tail*: ``--tail`` trajectories run one after another, as the stragglers at the end of a
  rollout step do; with idle cores the same reward run gets two and finishes sooner.

If the profile shows that a second core does not pay on this host (xdist start-up and a
noisy machine can eat the gain), it says so and the reward runs stay on one core. At the
end it prints, per phase and action kind, queue time, execution time, ACT (action
completion time = queue + execution) and the cores reward runs got, and where the daemon's
log is.

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

from tangram import AsyncClient, Client, ExecResult  # noqa: E402
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


MIN_SPEEDUP = 1.15  # below this a second core is not worth taking from anyone
_BURN = "x=0\nfor i in range(3_000_000): x=(x*1103515245+12345+i)&0x7FFFFFFF"


def parallel_capacity() -> float:
    """Cores' worth of work two processes pinned to two cores get done at once.

    About 2.0 on an idle 2-core host; about 1.0 where the "cores" are one core's worth
    (SMT siblings, a busy shared machine): then no scheduler can make a second core pay.
    """
    import subprocess

    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        return 1.0

    def burn(core: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", _BURN])

    t0 = time.monotonic()
    burn(cores[0]).wait()
    solo = time.monotonic() - t0
    t0 = time.monotonic()
    for p in [burn(c) for c in cores]:
        p.wait()
    pair = time.monotonic() - t0
    return 2 * solo / pair


def profile_suite(sock: str, scale: str, repeat: int) -> dict[str, Any]:
    """Profile the reward suite at DoP 1 and 2 (best of ``repeat``) and save it, as
    `tangramctl profile` does; elastic only if a second core really pays here."""
    with Client(sock) as c:
        env = c.env_open()
        dop: dict[str, float] = {}
        for k in (1, 2):
            times = []
            for _ in range(repeat):
                r = c.exec(reward_cmd(), env=env, cpus=k, env_vars={"CPU_SUITE_SCALE": scale})
                if r.outcome != "ok":
                    sys.exit(f"reward suite failed at -n {k}: {r.stdout[-500:]}{r.stderr[-500:]}")
                times.append(r.exec_s)
            dop[str(k)] = min(times)
        c.env_close(env)
        t1 = dop["1"]
        speedup = {k: t1 / v for k, v in dop.items()}
        eff = {k: min(1.0, s / int(k)) for k, s in speedup.items()}
        elastic = speedup["2"] >= MIN_SPEEDUP
        c.profile_save("reward-suite", dop=dop, t1_s=t1, eff=eff, speedup=speedup, elastic=elastic)
    return {"dop": dop, "speedup": speedup, "elastic": elastic}


def exec_row(
    phase: str, kind: str, submitted: float, r: ExecResult, cores: bool = False
) -> dict[str, Any]:
    """One exec's row of the summary: ``submitted`` is the client's monotonic time before the
    request (the same clock the daemon's ``queue_s`` and ``exec_s`` follow, on this host)."""
    row = {
        "phase": phase,
        "kind": kind,
        "id": r.action_id,
        "outcome": r.outcome,
        "submitted": submitted,
        "queue_s": r.queue_s,
        "exec_s": r.exec_s,
        "units": len(r.cores),
    }
    if cores:
        row["cores"] = len(r.cores)
    return row


async def trajectory(
    c: AsyncClient,
    k: int,
    steps: int,
    scale: str,
    rng: random.Random,
    rows: list[dict[str, Any]],
    progress: list[int],
    phase: str,
) -> None:
    env = await c.env_open(trajectory=f"traj-{k}")
    try:
        for _ in range(steps):
            await asyncio.sleep(rng.uniform(0.05, 0.4))  # LLM generation ("think time")
            if rng.random() < 0.3:
                t0 = time.monotonic()
                async with c.lease("search") as lease_id:
                    granted = time.monotonic()
                    await asyncio.sleep(rng.uniform(0.02, 0.08))  # the API call itself
                rows.append(
                    {
                        "phase": phase,
                        "kind": "api",
                        "id": lease_id,
                        "outcome": "ok",
                        "submitted": t0,
                        "queue_s": granted - t0,
                        "exec_s": time.monotonic() - granted,
                        "units": 1,
                    }
                )
            else:
                t0 = time.monotonic()
                r = await c.exec(rng.choice(TOOL_COMMANDS), env=env, cpus=1)
                rows.append(exec_row(phase, "tool", t0, r))
        await asyncio.sleep(rng.uniform(0.05, 0.4))
        t0 = time.monotonic()
        r = await c.exec(
            reward_cmd(), env=env, profile="reward-suite", env_vars={"CPU_SUITE_SCALE": scale}
        )
        rows.append(exec_row(phase, "reward", t0, r, cores=True))
        if r.outcome != "ok":
            print(
                f"\nreward run of traj-{k} ended {r.outcome}:\n{r.stdout[-800:]}{r.stderr[-800:]}",
                file=sys.stderr,
            )
    finally:
        await c.env_close(env)
        progress[0] += 1
        print(f"\r  trajectories done: {progress[0]}", end="", file=sys.stderr, flush=True)


async def rollout(
    sock: str, n: int, tail: int, steps: int, scale: str, seed: int
) -> list[dict[str, Any]]:
    """The crowded phase (``n`` trajectories at once), then the tail (one at a time)."""
    rows: list[dict[str, Any]] = []
    progress = [0]
    async with AsyncClient(sock) as c:
        await asyncio.gather(
            *(
                trajectory(
                    c, k, steps, scale, random.Random(seed * 1000 + k), rows, progress, "crowded"
                )
                for k in range(n)
            )
        )
        for k in range(n, n + tail):
            rng = random.Random(seed * 1000 + k)
            await trajectory(c, k, steps, scale, rng, rows, progress, "tail")
    print(file=sys.stderr)
    return rows


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per ``phase/kind``: counts, outcomes, queue/exec/ACT percentiles, reward cores."""
    out: dict[str, Any] = {}
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_kind[f"{r['phase']}/{r['kind']}"].append(r)
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
        if kind.endswith("/reward"):
            row["cores_used"] = dict(sorted(_count(r.get("cores", 0) for r in rs).items()))
        out[kind] = row
    return out


WAIT_NOTE_S = 1.0  # a kind whose queue p99 reaches this gets its waits explained
_STATE_WORDS = {
    "waiting_env": "for its environment (being created, or waiting for memory)",
    "waiting_mem": "for memory",
}


def _resource(pool: str) -> str:
    family = pool.split(":", 1)[0]
    return {"cpu": "cores", "api": "API leases", "gpu": "GPUs"}.get(family, pool)


def wait_states(story: dict[str, Any]) -> tuple[dict[str, float], str | None]:
    """Seconds one action spent in each state before it ran, from its ``story`` (the
    daemon's record of its transitions), and the pool it was placed on (None: never)."""
    spent: dict[str, float] = defaultdict(float)
    pool = None
    state, since = None, 0.0
    for e in story["events"]:
        name = e["event"]
        if name == "placed":
            for word in str(e["detail"]).split():
                if word.startswith("pool="):
                    pool = word[len("pool=") :]
            continue
        if name == "submitted":
            continue
        if state is not None:
            spent[state] += e["t"] - since
        if name in ("running", "finished", "done"):
            break
        state, since = name, e["t"]
    return dict(spent), pool


def explain_waits(
    c: Client,
    rows: list[dict[str, Any]],
    capacity: dict[str, int],
    min_wait_s: float = WAIT_NOTE_S,
    examine: int = 5,
) -> dict[str, Any]:
    """Why each phase/kind with a queue p99 of ``min_wait_s`` or more waited, from real data:
    the daemon's story of its ``examine`` longest waits (which state they waited in and for
    which pool) and the rows (what held that resource meanwhile: the average units each
    phase/kind held over those waits, and how many of each were placed while they waited).
    ``capacity``: the units of each pool (the daemon's ``status``)."""
    out: dict[str, Any] = {}
    by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_kind[f"{r['phase']}/{r['kind']}"].append(r)
    for kind, rs in sorted(by_kind.items()):
        if pct([r["queue_s"] for r in rs], 0.99) < min_wait_s:
            continue
        worst = sorted(rs, key=lambda r: r["queue_s"], reverse=True)[:examine]
        waited_in: dict[str, float] = defaultdict(float)
        pools: dict[str, int] = defaultdict(int)
        for w in worst:
            try:
                spent, pool = wait_states(c.story(w["id"]))
            except Exception as exc:  # forgotten (too old): say so, explain the others
                waited_in[f"unknown ({type(exc).__name__})"] += w["queue_s"]
                continue
            for state, secs in spent.items():
                label = (
                    f"queued for {_resource(pool)} ({pool})"
                    if state == "queued" and pool
                    else _STATE_WORDS.get(state, state)
                )
                waited_in[label] += secs
            if pool:
                pools[pool] += 1
        family = worst[0]["kind"] == "api"  # leases share the API; execs share the cores
        held: dict[str, float] = defaultdict(float)
        placed: dict[str, int] = defaultdict(int)
        window = sum(w["queue_s"] for w in worst)
        for w in worst:
            lo, hi = w["submitted"], w["submitted"] + w["queue_s"]
            for r in rows:
                if r is w or (r["kind"] == "api") != family:
                    continue
                start = r["submitted"] + r["queue_s"]
                end = start + r["exec_s"]
                overlap = min(hi, end) - max(lo, start)
                other = f"{r['phase']}/{r['kind']}"
                if overlap > 0:
                    held[other] += overlap * r.get("units", 1)
                if lo < start < hi:
                    placed[other] += 1
        pool = max(pools, key=lambda p: pools[p]) if pools else None
        out[kind] = {
            "examined": len(worst),
            "longest_s": worst[0]["queue_s"],
            "waited_in_s": dict(sorted(waited_in.items(), key=lambda kv: -kv[1])),
            "pool": pool,
            "capacity": capacity.get(pool) if pool else None,
            "held_meanwhile": {
                k: v / window for k, v in sorted(held.items(), key=lambda kv: -kv[1])
            },
            "placed_meanwhile": dict(sorted(placed.items(), key=lambda kv: -kv[1])),
        }
    return out


def wait_lines(waits: dict[str, Any]) -> list[str]:
    """The summary's sentences for ``explain_waits``' findings, one per phase/kind."""
    lines = []
    for kind, w in waits.items():
        total = sum(w["waited_in_s"].values()) or 1.0
        where = ", ".join(
            f"{100 * secs / total:.0f}% {label}" for label, secs in w["waited_in_s"].items()
        )
        unit = _resource(w["pool"]) if w["pool"] else "units"
        the = f"the {w['capacity']} {unit}" if w["capacity"] is not None else f"the {unit}"
        held = " and ".join(
            f"{k} ({v:.2f} on average)" for k, v in w["held_meanwhile"].items() if v >= 0.005
        )
        placed = ", ".join(f"{n} {k}" for k, n in w["placed_meanwhile"].items())
        which = (
            f"its wait ({w['longest_s']:.1f} s) was"
            if w["examined"] == 1
            else f"its {w['examined']} longest waits (up to {w['longest_s']:.1f} s) were"
        )
        line = f"{kind}: {which} {where or 'not in the daemon story'}"
        if held:
            line += f"; meanwhile {the} were held by {held}"
        if placed:
            line += f"; placed while they waited: {placed}"
        lines.append(line)
    return lines


def _count(values: Any) -> dict[int, int]:
    c: dict[int, int] = defaultdict(int)
    for v in values:
        c[v] += 1
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description="Drive an example rollout through tangramd.")
    ap.add_argument("--trajectories", type=int, default=6, help="crowded phase: at once")
    ap.add_argument("--tail", type=int, default=2, help="tail phase: one after another")
    ap.add_argument("--steps", type=int, default=4, help="tool/API actions per trajectory")
    ap.add_argument(
        "--scale",
        default="3.0",
        help="reward suite work (3.0 ≈ 12-18 s at one core: enough that the second core pays "
        "for pytest-xdist's ~2 s of worker start-up)",
    )
    ap.add_argument("--repeat", type=int, default=1, help="profile runs per DoP (best kept)")
    ap.add_argument("--socket", default=None, help="use a running daemon instead of starting one")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    daemon = None
    if args.socket:
        sock = args.socket
    else:
        tmp = Path(tempfile.mkdtemp(prefix="tangram-demo-"))
        print(
            f"starting tangramd up (socket {tmp / 'tangramd.sock'}, log {tmp / 'tangramd.log'})",
            file=sys.stderr,
        )
        daemon = spawn_daemon(tmp, CONFIG)
        sock = daemon.socket
    try:
        with Client(sock) as c:
            st = c.status()
            cores = st["pools"]["cpu:local"]["capacity"] if "cpu:local" in st["pools"] else "?"
        print(f"daemon up: backend={st['backend']} cores={cores}", file=sys.stderr)
        capacity = parallel_capacity()
        print(
            f"this host runs two pinned processes at {capacity:.2f} cores' worth of work"
            + ("" if capacity >= 1.5 else " (busy or SMT: a second core can hardly pay here)"),
            file=sys.stderr,
        )
        print(
            f"profiling the reward suite at -n 1 and -n 2 (best of {args.repeat}) ...",
            file=sys.stderr,
        )
        prof = profile_suite(sock, args.scale, args.repeat)
        verdict = (
            "elastic: a second core pays"
            if prof["elastic"]
            else f"NOT elastic here: speedup below {MIN_SPEEDUP}, reward runs stay on 1 core"
        )
        print(
            f"  T(1)={prof['dop']['1']:.2f}s T(2)={prof['dop']['2']:.2f}s "
            f"speedup(2)={prof['speedup']['2']:.2f} ({verdict})",
            file=sys.stderr,
        )
        print(
            f"running {args.trajectories} trajectories at once, then {args.tail} one at a "
            f"time, {args.steps} actions + a reward run each ...",
            file=sys.stderr,
        )
        t0 = time.monotonic()
        rows = asyncio.run(
            rollout(sock, args.trajectories, args.tail, args.steps, args.scale, args.seed)
        )
        wall = time.monotonic() - t0
        with Client(sock) as c:
            st = c.status()
            passes = st["passes"]
            pool_units = {
                name: pool["capacity"]
                for name, pool in st["pools"].items()
                if isinstance(pool, dict) and "capacity" in pool
            }
            waits = explain_waits(c, rows, pool_units)
    finally:
        if daemon is not None:
            code = daemon.stop()
            where = (
                f"tangramd stopped (exit {code}); its log: {daemon.log_path}\n"
                f"remove the demo's files with: rm -rf {daemon.log_path.parent}"
            )
            if sys.exc_info()[0] is not None:  # failed: say it now; else after the summary
                print(where, file=sys.stderr)
    summary = {
        "wall_s": wall,
        "actions": len(rows),
        "scheduler_passes": passes,
        "profile": prof,
        "parallel_capacity": capacity,
        "kinds": summarise(rows),
        "waits": waits,
        "log": str(daemon.log_path) if daemon is not None else None,
    }
    if args.json:
        print(json.dumps(summary, indent=1), flush=True)
    else:
        print_summary(summary, args)
    if daemon is not None:
        print(where, file=sys.stderr)


def print_summary(summary: dict[str, Any], args: argparse.Namespace) -> None:
    """The table, why the kinds that queued long waited, and the reward runs' cores."""
    rows, wall, passes, prof = (
        summary["actions"],
        summary["wall_s"],
        summary["scheduler_passes"],
        summary["profile"],
    )
    print(
        f"\n{rows} actions from {args.trajectories + args.tail} trajectories "
        f"({args.trajectories} crowded, {args.tail} tail) in {wall:.1f} s "
        f"({passes} scheduling passes)\n"
    )
    head = (
        f"{'phase/kind':<16}{'count':>6}{'queue p50':>11}{'queue p99':>11}{'exec p50':>10}"
        f"{'ACT avg':>9}{'ACT p99':>9}  outcomes"
    )
    print(head)
    print("-" * len(head))
    for kind, r in summary["kinds"].items():
        outcomes = " ".join(f"{k}={v}" for k, v in r["outcomes"].items())
        extra = f"  cores={r['cores_used']}" if "cores_used" in r else ""
        print(
            f"{kind:<16}{r['count']:>6}{r['queue_p50_s']:>10.3f}s{r['queue_p99_s']:>10.3f}s"
            f"{r['exec_p50_s']:>9.3f}s{r['act_avg_s']:>8.3f}s{r['act_p99_s']:>8.3f}s  "
            f"{outcomes}{extra}"
        )
    if summary["waits"]:
        print(
            f"\nwhy queue p99 reached {WAIT_NOTE_S:.0f} s or more (the daemon's story of the "
            "longest waits; what held the resource meanwhile, from the results):"
        )
        for line in wait_lines(summary["waits"]):
            print(f"  {line}")
    crowded = summary["kinds"].get("crowded/reward", {}).get("cores_used", {})
    tail = summary["kinds"].get("tail/reward", {}).get("cores_used", {})
    print(
        f"\nreward runs' cores: crowded phase {crowded}, tail phase {tail} "
        f"(profile speedup at 2 cores: {prof['speedup']['2']:.2f})",
        flush=True,
    )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
