"""Cluster mode benchmarks: real daemons on loopback, plus the core's pass in-process.

Usage: python bench/cluster.py [--json] [--acts N] [--rounds N] [--clients N]
                                [--skip a,b,c,d] [--against TREE]

(a) ACT overhead of ``true``: the client-measured round trip of one exec in an open
    environment through node → coordinator → node, against ``tangramd up``, both running,
    in alternating rounds of the same run;
(b) throughput with 4 nodes and ``--clients`` concurrent clients spread over their sockets;
(c) one scheduling pass of the coordinator's core at 16 nodes × 64 cores with 1,024 queued
    actions (80% 1 core, 20% elastic), next to the same pass over one 1,024-core node (the
    same queue and free cores in one pool) and ``bench/sched.py``'s single-node scheduler
    case (1,024 queued, 256 cores), all in the same process; wall and thread CPU time;
(d) node death: SIGKILL of a node while an action runs there, until its client holds the
    ``infra_error``; coordinator restart: SIGKILL, restart, until every node is ready.

On a small host all daemons share its cores: absolute numbers are upper bounds.
``--against TREE`` (another checkout, e.g. main) pairs (a) and (c) with it in the same run:
(a) adds a second coordinator and node running that tree's code, in the same rotation of
rounds, and reports each side's CPU per exec; (c) runs each pass alternately here and in a
worker process on that tree (same seeds) and reports the paired CPU ratio. On a loaded host
these paired figures are the ones to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from tangram import AsyncClient, Client  # noqa: E402
from tangram.pools.cpu import CpuCluster  # noqa: E402
from tangram.protocol.results import ExecSpec  # noqa: E402
from tangram.testing import (  # noqa: E402
    node_row,
    spawn_coordinator,
    spawn_daemon,
    spawn_node,
    wait_node_state,
)
from tangram.testing import wait_for_daemon as wait_for  # noqa: E402
from tangramd import events as ev  # noqa: E402
from tangramd.state import Core, CoreConfig  # noqa: E402

GIB = 1 << 30
CORES = sorted(os.sched_getaffinity(0))
TIMEOUT_S = 2.0
CONFIG = f"""
[cluster]
heartbeat_s = 0.25
heartbeat_timeout_s = {TIMEOUT_S}

[cpu]
default_env_mem = "64MiB"
"""
UP_CONFIG = '[cpu]\ndefault_env_mem = "64MiB"\n'


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _stats_ms(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(statistics.median(values) * 1e3, 3),
        "p99_ms": round(pct(values, 0.99) * 1e3, 3),
        "mean_ms": round(statistics.fmean(values) * 1e3, 3),
    }


def _act_loop(client: Client, env: str, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        result = client.exec(["true"], env=env)
        times.append(time.perf_counter() - t0)
        assert result.outcome == "ok", result
    return times


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (Linux /proc)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def bench_act(work: Path, n: int, rounds: int = 6, against: str | None = None) -> dict[str, Any]:
    """The daemons up at once, ``rounds`` rotating runs of ``n / rounds`` execs each, so
    that a change in the host's load reaches every side alike."""
    up = spawn_daemon(work / "up", UP_CONFIG)
    daemons = [up]
    pids = {"up": [up.proc.pid]}
    sockets = {"up": up.socket}
    trees = {"node": None} if against is None else {"node": None, "against": against}
    times: dict[str, list[float]] = {"up": []}
    try:
        for side, tree in trees.items():
            # PYTHONSAFEPATH: `python -m` would put the working directory (this tree, when
            # run from it) before PYTHONPATH
            env = None if tree is None else {"PYTHONPATH": tree, "PYTHONSAFEPATH": "1"}
            coord = spawn_coordinator(work / side, CONFIG, env=env)
            daemons.append(coord)
            node = spawn_node(work / side, coord, "n1", cpus=",".join(map(str, CORES)), env=env)
            daemons.append(node)
            pids[side] = [coord.proc.pid, node.proc.pid]
            sockets[side], times[side] = node.socket, []
        clients = {side: Client(path) for side, path in sockets.items()}
        sides = {side: (c, c.env_open()) for side, c in clients.items()}
        for client, env in sides.values():
            _act_loop(client, env, 20)  # warm-up
        names = list(sides)
        cpu = dict.fromkeys(names, 0.0)
        for r in range(rounds):
            for side in names[r % len(names) :] + names[: r % len(names)]:
                client, env = sides[side]
                c0 = _cpu_s(pids[side])
                times[side] += _act_loop(client, env, max(1, n // rounds))
                cpu[side] += _cpu_s(pids[side]) - c0
        for client, env in sides.values():
            client.env_close(env)
            client.close()
    finally:
        for daemon in reversed(daemons):
            daemon.stop()
    stats = {side: _stats_ms(t) for side, t in times.items()}
    a, b = stats["up"], stats["node"]
    out: dict[str, Any] = {
        "actions": len(times["up"]),
        "rounds": rounds,
        "tangramd_up": a,
        "through_node": b,
        "extra_p50_ms": round(b["p50_ms"] - a["p50_ms"], 3),
        "extra_p99_ms": round(b["p99_ms"] - a["p99_ms"], 3),
        # the daemons' CPU per exec (the up daemon; the coordinator and node together)
        "cpu_ms_per_exec": {side: round(cpu[side] / len(times[side]) * 1e3, 3) for side in cpu},
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    if against is not None:
        c = stats["against"]
        out["against"] = {
            "tree": against,
            "through_node": c,
            "extra_p50_ms": round(c["p50_ms"] - a["p50_ms"], 3),
            "extra_p99_ms": round(c["p99_ms"] - a["p99_ms"], 3),
        }
    return out


def bench_throughput(work: Path, clients: int, per_client: int) -> dict[str, Any]:
    coord = spawn_coordinator(work / "tput", CONFIG)
    nodes = [
        spawn_node(work / "tput", coord, f"n{i}", cpus=str(CORES[i % len(CORES)])) for i in range(4)
    ]
    try:

        async def one(sock: str, out: list[str]) -> None:
            async with AsyncClient(sock) as c:
                for _ in range(per_client):
                    out.append((await c.exec(["true"])).outcome)

        async def run() -> list[str]:
            out: list[str] = []
            await asyncio.gather(*(one(nodes[i % 4].socket, out) for i in range(clients)))
            return out

        t0 = time.perf_counter()
        outcomes = asyncio.run(run())
        wall = time.perf_counter() - t0
        placed = {row["name"]: row for row in Client(coord.socket).nodes()}
    finally:
        for node in nodes:
            node.stop()
        coord.stop()
    return {
        "nodes": 4,
        "clients": clients,
        "actions": len(outcomes),
        "ok": outcomes.count("ok"),
        "wall_s": round(wall, 3),
        "actions_per_s": round(len(outcomes) / wall, 1),
        "nodes_seen": sorted(placed),
    }


def _queued_core(nodes: int, cores: int, queued: int, seed: int = 0) -> Core:
    rng = random.Random(seed)
    core = Core(CpuCluster([]), {}, CoreConfig(default_env_mem=64 << 20))
    for i in range(nodes):
        half = cores // 2
        numa = (tuple(range(half)), tuple(range(half, cores)))
        core.handle(ev.NodeJoined(node=f"n{i:02d}", cores_by_numa=numa, mem_bytes=512 * GIB), 0)
    for i in range(queued):
        if rng.random() < 0.8:
            spec = ExecSpec(cmd="true", cpus=1)
        else:
            amounts = sorted(rng.sample(range(1, 17), 2))
            eff = {str(m): max(0.3, 1.0 - 0.02 * (m - 1)) for m in range(1, amounts[1] + 1)}
            spec = ExecSpec(cmd="pytest", cpus=(amounts[0], amounts[1]), t1_s=60.0, eff=eff)
        for cmd in core.handle(ev.SubmitExec(spec=spec, token=i + 1), 0):
            if isinstance(cmd, ev.CreateEnv):
                core.handle(ev.EnvCreated(env_id=cmd.env_id), 0)
    assert len(core.actions.queue) == queued, len(core.actions.queue)
    return core


def _core_pass(nodes: int, cores: int, repeat: int) -> dict[str, Any]:
    """The core's whole pass (scheduler, stories, commands), wall and thread CPU time."""
    wall, cpu, placed = [], [], []
    for seed in range(repeat):
        core = _queued_core(nodes, cores, 1024, seed)
        gc.collect()
        t0, c0 = time.perf_counter(), time.thread_time()
        out = core.handle(ev.Tick(), 1.0)
        cpu.append(time.thread_time() - c0)
        wall.append(time.perf_counter() - t0)
        placed.append(sum(isinstance(c, ev.RunExec) for c in out))
    return {
        **_stats_ms(wall),
        "cpu_p50_ms": round(statistics.median(cpu) * 1e3, 3),
        "placed_mean": round(statistics.fmean(placed), 1),
    }


_PASS_WORKER = """
import gc, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/bench"]
import cluster as B
from tangramd import events as ev
for line in sys.stdin:
    core = B._queued_core(16, 64, 1024, int(line))
    gc.collect()
    c0 = time.thread_time()
    out = core.handle(ev.Tick(), 1.0)
    placed = sum(isinstance(c, ev.RunExec) for c in out)
    print(time.thread_time() - c0, placed, flush=True)
"""


def _paired_pass(repeat: int, against: str) -> dict[str, Any]:
    """The 16 x 64 pass here and in a worker on ``against``, alternating, the same seeds."""
    worker = subprocess.Popen(
        [sys.executable, "-c", _PASS_WORKER, against],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=against, PYTHONSAFEPATH="1"),
    )
    assert worker.stdin is not None and worker.stdout is not None
    here, there = [], []
    try:
        for seed in range(repeat):
            for side in ("here", "there") if seed % 2 == 0 else ("there", "here"):
                if side == "there":
                    worker.stdin.write(f"{seed}\n")
                    worker.stdin.flush()
                    cpu, placed = worker.stdout.readline().split()
                    there.append((float(cpu), int(placed)))
                else:
                    core = _queued_core(16, 64, 1024, seed)
                    gc.collect()
                    c0 = time.thread_time()
                    out = core.handle(ev.Tick(), 1.0)
                    placed_here = sum(isinstance(c, ev.RunExec) for c in out)
                    here.append((time.thread_time() - c0, placed_here))
    finally:
        worker.stdin.close()
        worker.wait(30)
    return {
        "tree": against,
        "cpu_p50_ms": round(statistics.median(c for c, _ in there) * 1e3, 3),
        "cpu_p50_ms_here": round(statistics.median(c for c, _ in here) * 1e3, 3),
        "paired_cpu_ratio_p50": round(
            statistics.median(h[0] / t[0] for h, t in zip(here, there, strict=True)), 3
        ),
        "same_placement_counts": [p for _, p in here] == [p for _, p in there],
    }


def bench_pass(repeat: int, against: str | None = None) -> dict[str, Any]:
    cluster = _core_pass(16, 64, repeat)
    # the same queue and the same free cores in one pool: what "inside the single-node
    # targets" compares against (bench/sched.py times the scheduler alone, not the core)
    one_pool = _core_pass(1, 1024, repeat)
    from sched import run as single_node  # bench/sched.py

    reference = next(
        c
        for c in single_node(max(20, repeat), "fcfs")["cases"]
        if (c["queued"], c["units"]) == (1024, 256)
    )
    out = {
        "nodes": 16,
        "cores_per_node": 64,
        "queued": 1024,
        "placed": cluster["placed_mean"],
        "core_pass": cluster,
        "one_pool_same_count": {"nodes": 1, "cores_per_node": 1024, **one_pool},
        "cpu_ratio": round(cluster["cpu_p50_ms"] / one_pool["cpu_p50_ms"], 2),
        "single_pool_reference": {
            k: reference[k] for k in ("queued", "units", "p50_ms", "p99_ms", "placed")
        },
    }
    if against is not None:
        out["against"] = _paired_pass(max(repeat, 20), against)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_death(work: Path) -> float:
    """Seconds from SIGKILL of the node running an action to its client's infra_error."""
    coord = spawn_coordinator(work, CONFIG)
    a = spawn_node(work, coord, "a", cpus=str(CORES[0]))
    b = spawn_node(work, coord, "b", cpus=str(CORES[-1]))
    try:
        with a.client() as c:
            opened = (c.request("env.open", {}) for _ in range(8))
            env = next(e["id"] for e in opened if e["node"] == "b")
        box: dict[str, Any] = {}

        def run() -> None:
            with Client(a.socket) as c:
                box["r"] = c.exec(["sleep", "60"], env=env)
                box["t"] = time.monotonic()

        thread = threading.Thread(target=run)
        thread.start()
        wait_for(lambda: node_row(coord, "b")["running"] == 1, 10, "running on b")
        killed = time.monotonic()
        b.kill()
        thread.join(TIMEOUT_S + 10)
        assert box["r"].outcome == "infra_error", box
        return float(box["t"] - killed)
    finally:
        a.stop()
        coord.stop()


def bench_failures(work: Path, repeat: int) -> dict[str, Any]:
    deaths = [_one_death(work / f"death{k}") for k in range(repeat)]
    restarts = []
    for k in range(repeat):
        listen = f"127.0.0.1:{_free_port()}"
        coord = spawn_coordinator(work / f"restart{k}", CONFIG, listen=listen)
        nodes = [
            spawn_node(work / f"restart{k}", coord, f"n{i}", cpus=str(CORES[i % len(CORES)]))
            for i in range(4)
        ]
        try:
            coord.kill()
            t0 = time.monotonic()
            coord = spawn_coordinator(work / f"restart{k}", CONFIG, listen=listen)
            for node in nodes:
                wait_node_state(coord, node.name, "ready", 30, node=node)
            restarts.append(time.monotonic() - t0)
        finally:
            for node in nodes:
                node.stop()
            coord.stop()
    return {
        "heartbeat_timeout_s": TIMEOUT_S,
        "node_death_to_infra_error_s": [round(x, 3) for x in deaths],
        "coordinator_restart_to_all_ready_s": [round(x, 3) for x in restarts],
        "nodes": 4,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--acts", type=int, default=300, help="(a) sequential execs per side")
    ap.add_argument("--rounds", type=int, default=6, help="(a) rotations of the sides")
    ap.add_argument("--clients", type=int, default=256, help="(b) concurrent clients")
    ap.add_argument("--per-client", type=int, default=4, help="(b) execs per client")
    ap.add_argument("--repeat", type=int, default=3, help="(c), (d) repetitions")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: a,b,c,d")
    ap.add_argument("--against", help="another checkout to pair (a) and (c) with (e.g. main)")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    work = Path(tempfile.mkdtemp(prefix="tangram-bench-cluster-"))
    result: dict[str, Any] = {"host_cores": len(CORES)}
    if "a" not in skip:
        result["a_act_overhead"] = bench_act(work, args.acts, args.rounds, args.against)
    if "b" not in skip:
        result["b_throughput"] = bench_throughput(work, args.clients, args.per_client)
    if "c" not in skip:
        result["c_pass"] = bench_pass(args.repeat, args.against)
    if "d" not in skip:
        result["d_failures"] = bench_failures(work, args.repeat)
    print(json.dumps(result, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
