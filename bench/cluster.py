"""Cluster mode benchmarks: real daemons on loopback, plus the core's pass in-process.

Usage: python bench/cluster.py [--json] [--acts N] [--rounds N] [--clients N]
                                [--nodes N [--window S]]
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

``--nodes N`` (e.g. 128) runs only (e), the coordinator at scale, and prints its JSON:
one real ``tangramd coordinator`` process (TLS, 1 s heartbeats) and N nodes.
(e1) join storm: N lightweight nodes start together; each one's time from the start until
     the coordinator's welcome (p50/p99), and until the coordinator lists all N ``ready``;
(e2) heartbeat cost: the coordinator's CPU seconds per second (user + system from
     /proc/<pid>/stat) over ``--window`` seconds with the N nodes heartbeating every second,
     beside the same coordinator's idle rate before the storm;
(e3) exec through one real node (``tangramd node``, every core of the host) while N - 1
     lightweight nodes heartbeat (one of the N leaves first): the client-measured ``true``
     exec through the cluster against ``tangramd up`` in alternating rounds (3,000 each:
     a p99 is then 30 samples, not the 6 of 600, which the host's noise moves by ms), the hop
     overhead as the difference of their p50/p99, sequential and concurrent execs/s, and
     the coordinator's CPU per exec; then the same again once the lightweight nodes have
     left (``alone``: the control, same daemons, same run).
The lightweight nodes are the real node code (``tangramd.cluster.daemon.build_node`` and
``serve_node``: TLS, join token and CA pin, heartbeats, a Unix socket each), offering no
cores as ``--cpus ''`` does, all on one event loop in a thread of this process. Not 128
``tangramd node`` processes: each costs ~1 s of CPU to start and ~50 MB, so on a 2-core
host the storm would time Python's start-up and the window would share the cores with
128 idle interpreters, not the coordinator's costs, which are the same either way: what
reaches the coordinator is the same TLS connections and the same link messages.
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

from tangram import AsyncClient, Client, _native  # noqa: E402
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


# --------------------------------------------------------------------------- (e) at scale

SCALE_CONFIG = """
[cluster]
heartbeat_s = 1.0
heartbeat_timeout_s = 10.0

[cpu]
default_env_mem = "64MiB"
"""
SCALE_GOALS = {"coordinator_cores": 1.0, "hop_p99_ms": 2.0}


class LightNodes:
    """``n`` nodes of the real node code (``build_node``, ``serve_node``) offering no cores,
    on one event loop in a background thread of this process (see the module doc)."""

    def __init__(self, work: Path, coord: Any, n: int) -> None:
        import logging

        import structlog

        from tangramd.cluster import config as cluster_config
        from tangramd.cluster.daemon import build_node, node_capacity
        from tangramd.cluster.link import split_host_port

        # their log lines (JSON, as a node writes them) go to a file, warnings and up
        self._log = open(work / "light-nodes.log", "w")  # noqa: SIM115
        self._structlog = dict(structlog.get_config())
        structlog.configure(
            processors=[structlog.processors.add_log_level, structlog.processors.JSONRenderer()],
            wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
            logger_factory=structlog.PrintLoggerFactory(self._log),
            cache_logger_on_first_use=False,
        )
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        join = coord.join
        self.agents: list[Any] = []
        self.stops: list[asyncio.Event] = []
        self.tasks: list[Any] = []
        for i in range(n):
            name = f"light{i:03d}"
            sock, state = work / name / "node.sock", work / name / "state"
            (work / name).mkdir(parents=True, exist_ok=True)
            config, _ = cluster_config.load(
                None, {"daemon.socket": str(sock), "daemon.state_dir": str(state)}
            )
            self.agents.append(
                build_node(
                    config,
                    name=name,
                    coordinator=split_host_port(join["coordinator"]),
                    token=join["token"] or None,
                    ca_sha256=join["ca_sha256"] or None,
                    insecure=False,
                    capacity=node_capacity(config, ""),  # --cpus ''
                )
            )

    def call(self, coro: Any, timeout_s: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def storm(self, timeout_s: float = 120.0) -> list[float]:
        """Start every node at once; each one's seconds from the start until its welcome
        (its link is up: the coordinator has attached it and fed ``NodeJoined``)."""
        from tangramd.cluster.daemon import serve_node

        async def run() -> list[float]:
            self.stops = [asyncio.Event() for _ in self.agents]
            t0 = time.perf_counter()
            self.tasks = [
                asyncio.create_task(serve_node(agent, stop))
                for agent, stop in zip(self.agents, self.stops, strict=True)
            ]
            joined: dict[int, float] = {}
            while len(joined) < len(self.agents):
                now = time.perf_counter()
                for i, agent in enumerate(self.agents):
                    if i not in joined and agent.link is not None:
                        joined[i] = now - t0
                if now - t0 > timeout_s:
                    raise TimeoutError(f"{len(joined)}/{len(self.agents)} nodes joined")
                await asyncio.sleep(0.002)
            return [joined[i] for i in range(len(self.agents))]

        return list(self.call(run(), timeout_s + 10))

    def stop(self, index: int | None = None) -> None:
        """Stop one node (``index``) or all, gracefully (their goodbye)."""

        async def run() -> None:
            chosen = range(len(self.tasks)) if index is None else [index]
            for i in chosen:
                self.stops[i].set()
            await asyncio.gather(*(self.tasks[i] for i in chosen), return_exceptions=True)

        self.call(run())

    def close(self) -> None:
        import structlog

        try:
            if self.tasks:
                self.stop()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()
            structlog.configure(**self._structlog)
            self._log.close()


def _ready_count(coord: Any) -> int:
    with Client(coord.socket) as c:
        return sum(row.get("state") == "ready" for row in c.nodes())


def _cpu_rate(pid: int, window_s: float) -> float:
    """CPU seconds per second of ``pid`` over the next ``window_s`` seconds."""
    c0, t0 = _cpu_s([pid]), time.perf_counter()
    time.sleep(window_s)  # a measurement window, not a synchronisation
    return (_cpu_s([pid]) - c0) / (time.perf_counter() - t0)


def _concurrent(sock: str, clients: int, per_client: int, env: str | None) -> tuple[int, float]:
    async def one(out: list[str]) -> None:
        async with AsyncClient(sock) as c:
            for _ in range(per_client):
                out.append((await c.exec(["true"], env=env)).outcome)

    async def run() -> list[str]:
        out: list[str] = []
        await asyncio.gather(*(one(out) for _ in range(clients)))
        return out

    t0 = time.perf_counter()
    outcomes = asyncio.run(run())
    wall = time.perf_counter() - t0
    assert outcomes.count("ok") == len(outcomes), outcomes
    return len(outcomes), wall


def _exec_rounds(
    sides: dict[str, Client], envs: dict[str, str], acts: int, rounds: int, coord_pid: int
) -> dict[str, Any]:
    """``acts`` execs of ``true`` per side in ``rounds`` alternating rounds; the
    coordinator's CPU over the node's rounds."""
    times: dict[str, list[float]] = {side: [] for side in sides}
    for side, c in sides.items():
        _act_loop(c, envs[side], 20)  # warm-up
    names, cpu = list(sides), 0.0
    for r in range(rounds):
        for side in names[r % 2 :] + names[: r % 2]:
            c0 = _cpu_s([coord_pid])
            times[side] += _act_loop(sides[side], envs[side], max(1, acts // rounds))
            if side == "node":
                cpu += _cpu_s([coord_pid]) - c0
    return {"times": times, "coordinator_cpu_s": cpu}


def _hop(run: dict[str, Any]) -> dict[str, Any]:
    """Through the node against ``tangramd up``: each side's ACT, their difference at p50
    and p99 (the hop), the coordinator's CPU per exec."""
    up, node = (_stats_ms(run["times"][side]) for side in ("up", "node"))
    return {
        "tangramd_up": up,
        "through_node": node,
        "hop_p50_ms": round(node["p50_ms"] - up["p50_ms"], 3),
        "hop_p99_ms": round(node["p99_ms"] - up["p99_ms"], 3),
        "coordinator_cpu_ms_per_exec": round(
            run["coordinator_cpu_s"] / len(run["times"]["node"]) * 1e3, 3
        ),
    }


def bench_scale(
    work: Path,
    nodes: int,
    window_s: float,
    acts: int,
    rounds: int = 6,
    clients: int = 8,
    per_client: int = 25,
) -> dict[str, Any]:
    work = work / "scale"
    coord = spawn_coordinator(work, SCALE_CONFIG)
    daemons: list[Any] = [coord]
    light = None
    try:
        idle = _cpu_rate(coord.proc.pid, min(window_s, 5.0))
        light = LightNodes(work, coord, nodes)
        c0 = _cpu_s([coord.proc.pid])
        t0 = time.perf_counter()
        joined = light.storm()
        wait_for(lambda: _ready_count(coord) == nodes, 60, f"{nodes} nodes ready")
        all_ready = time.perf_counter() - t0
        storm_cpu = _cpu_s([coord.proc.pid]) - c0
        beating = _cpu_rate(coord.proc.pid, window_s)

        # (e3) one real node with every core; one light node leaves: N nodes in all
        up = spawn_daemon(work / "up", UP_CONFIG)
        daemons.append(up)
        node = spawn_node(work, coord, "exec", cpus=",".join(map(str, CORES)))
        daemons.append(node)
        light.stop(0)
        wait_for(lambda: _ready_count(coord) == nodes, 30, f"{nodes} nodes ready with exec")
        sides = {"up": Client(up.socket), "node": Client(node.socket)}
        envs = {side: c.env_open() for side, c in sides.items()}
        crowded = _exec_rounds(sides, envs, acts, rounds, coord.proc.pid)
        seq = {side: len(t) / sum(t) for side, t in crowded["times"].items()}
        conc = {}
        for side, daemon in (("up", up), ("node", node)):
            count, wall = _concurrent(daemon.socket, clients, per_client, envs[side])
            conc[side] = round(count / wall, 1)
        ready_end = _ready_count(coord)
        # the control: the same daemons once the lightweight nodes have left
        light.close()
        light = None
        wait_for(lambda: _ready_count(coord) == 1, 30, "the light nodes gone")
        alone = _exec_rounds(sides, envs, acts, rounds, coord.proc.pid)
        for side, c in sides.items():
            c.env_close(envs[side])
            c.close()
    finally:
        if light is not None:
            light.close()
        for daemon in reversed(daemons):
            daemon.stop()
    hop = _hop(crowded)
    return {
        "nodes": nodes,
        "heartbeat_s": 1.0,
        "join_storm": {
            "nodes": nodes,
            "to_welcome": _stats_ms(joined),
            "max_to_welcome_ms": round(max(joined) * 1e3, 3),
            "all_ready_s": round(all_ready, 3),
            "coordinator_cpu_s": round(storm_cpu, 3),
        },
        "heartbeats": {
            "window_s": window_s,
            "coordinator_cores": round(beating, 4),
            "coordinator_cores_idle_before": round(idle, 4),
            "cpu_ms_per_heartbeat": round((beating - idle) / nodes * 1e3, 4),
            "goal_cores": SCALE_GOALS["coordinator_cores"],
            "meets_goal": beating <= SCALE_GOALS["coordinator_cores"],
        },
        "exec": {
            "heartbeating_nodes": nodes - 1,
            "actions_per_side": len(crowded["times"]["node"]),
            "rounds": rounds,
            **hop,
            "goal_hop_p99_ms": SCALE_GOALS["hop_p99_ms"],
            "meets_goal": hop["hop_p99_ms"] <= SCALE_GOALS["hop_p99_ms"],
            "sequential_execs_per_s": {k: round(v, 1) for k, v in seq.items()},
            "concurrent_execs_per_s": {"clients": clients, **conc},
            "nodes_ready_at_end": ready_end,
            # the same daemons, the same run, once the heartbeating nodes have left
            "alone": _hop(alone),
        },
        "host_cores": len(CORES),
        # the coordinator imports the same tree: is its core the compiled one?
        "core_compiled": _native.ACTIVE,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--acts", type=int, help="sequential execs per side: (a) 300; (e) 3000 per phase"
    )
    ap.add_argument("--rounds", type=int, default=6, help="(a) rotations of the sides")
    ap.add_argument("--clients", type=int, default=256, help="(b) concurrent clients")
    ap.add_argument("--per-client", type=int, default=4, help="(b) execs per client")
    ap.add_argument("--repeat", type=int, default=3, help="(c), (d) repetitions")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: a,b,c,d")
    ap.add_argument("--against", help="another checkout to pair (a) and (c) with (e.g. main)")
    ap.add_argument("--nodes", type=int, help="(e) only: the coordinator with this many nodes")
    ap.add_argument("--window", type=float, default=30.0, help="(e) heartbeat window, seconds")
    args = ap.parse_args()
    if args.nodes is not None:
        if args.nodes < 2:
            ap.error(f"--nodes: at least 2 (one real node and one lightweight), got {args.nodes}")
        if args.window <= 0:
            ap.error(f"--window: a positive number of seconds, got {args.window}")
        work = Path(tempfile.mkdtemp(prefix="tangram-bench-cluster-"))
        acts = 3000 if args.acts is None else args.acts  # a p99 of 30 samples
        scale = bench_scale(work, args.nodes, args.window, acts, args.rounds)
        print(json.dumps({"e_scale": scale}, indent=None if args.json else 1))
        return
    skip = set(filter(None, args.skip.split(",")))
    work = Path(tempfile.mkdtemp(prefix="tangram-bench-cluster-"))
    result: dict[str, Any] = {"host_cores": len(CORES)}
    if "a" not in skip:
        acts = 300 if args.acts is None else args.acts
        result["a_act_overhead"] = bench_act(work, acts, args.rounds, args.against)
    if "b" not in skip:
        result["b_throughput"] = bench_throughput(work, args.clients, args.per_client)
    if "c" not in skip:
        result["c_pass"] = bench_pass(args.repeat, args.against)
    if "d" not in skip:
        result["d_failures"] = bench_failures(work, args.repeat)
    print(json.dumps(result, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
