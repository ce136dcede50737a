"""Latency of one full scheduling pass (candidates + greedy eviction + DP + objective).

Usage: python bench/sched.py [--json] [--repeat N] [--order fcfs|backfill]
       [--rule priced|wait-eft|wait|paper] [--gc daemon|plain|frozen] [--cpu-time]

Each case builds a realistic mix over CPU node pools holding ``units`` free cores in total
(nodes of up to 256 cores, two NUMA nodes each), a 2-node GPU pool and one API endpoint:
~80% short non-elastic exec actions, ~12% elastic exec actions with 5-10 allowed amounts
and a profile, ~5% GPU service actions ({1,2,4,8} GPUs), ~3% API calls. Half of the
trajectories already have a node. Prints p50/p99 over ``--repeat`` passes.
``--gc`` is how the cyclic garbage collector sees the objects: ``daemon`` (the default)
as under ``tangramd``, which freezes its start-up objects (modules, config, pools) once it
is ready, so a full collection walks only what was made since (here: the queue and the
pools' state); ``plain`` freezes nothing (full collections also walk every module of this
process); ``frozen`` (``--gc-freeze``) also freezes the built queue (no daemon does that:
it shows the collector's whole share of the tail).
``--cpu-time`` times each pass with the thread's CPU clock instead of the wall clock: on a
shared machine it leaves out the time other processes hold the CPU (not cache effects).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangram.model import TrajectoryId, make_action
from tangram.pools.api import ApiPool
from tangram.pools.cpu import CpuNodePool
from tangram.pools.gpu import GpuCluster, GpuNodePool, ServiceSpec
from tangram.sched import SchedConfig, Snapshot, schedule

CASES = [(64, 64), (256, 256), (1024, 256), (4096, 1024)]
GIB = 1 << 30


def build(queued: int, units: int, seed: int = 0):
    rng = random.Random(seed)
    n_nodes = max(1, units // 256)
    per_node = units // n_nodes
    pools = {}
    for i in range(n_nodes):
        half = per_node // 2
        cores = [list(range(0, half)), list(range(half, per_node))]
        pool = CpuNodePool(f"n{i}", cores, 2048 * GIB)
        pools[pool.pool_id] = pool
    gpu_nodes = [
        GpuNodePool(f"g{i}", 8, mem_per_gpu=80 * GIB, h2d_bytes_per_s=25e9) for i in range(2)
    ]
    services = {f"judge{k}": ServiceSpec(f"judge{k}", 30 * GIB) for k in range(4)}
    gpu = GpuCluster(gpu_nodes, services)
    pools[gpu.pool_id] = gpu
    api = ApiPool("search", concurrency=32, quota=0, period_s=60.0)
    pools[api.pool_id] = api
    cpu_ids = sorted(p for p in pools if p.startswith("cpu:"))
    affinity = {}
    waiting = []
    for i in range(queued):
        traj = f"t{i}"  # one pending action per trajectory (actions are sequential)
        if rng.random() < 0.5:
            affinity[TrajectoryId(traj)] = cpu_ids[i % len(cpu_ids)]
        r = rng.random()
        if r < 0.80:
            a = make_action(f"a{i}", "exec", traj, {"cpu": 1}, seq=i, dur_s=rng.uniform(0.001, 2))
        elif r < 0.92:
            k = rng.randint(5, 10)
            amounts = sorted(rng.sample(range(1, 33), k))
            eff = {m: max(0.3, 1.0 - 0.02 * (m - 1)) for m in amounts}
            a = make_action(
                f"a{i}",
                "exec",
                traj,
                {"cpu": {"set": amounts}},
                seq=i,
                t1_s=rng.uniform(30, 300),
                eff=eff,
            )
        elif r < 0.97:
            a = make_action(
                f"a{i}",
                "service",
                traj,
                {"gpu": {"set": [1, 2, 4, 8]}},
                seq=i,
                service=f"judge{rng.randrange(4)}",
                t1_s=rng.uniform(2, 20),
                eff={1: 1.0, 2: 0.9, 4: 0.8, 8: 0.6},
            )
        else:
            a = make_action(f"a{i}", "api", traj, {"api:search": 1}, seq=i, dur_s=0.5)
        waiting.append(a)
    running = {
        pid: [(rng.uniform(0.1, 60.0), 1) for _ in range(rng.randint(4, 32))] for pid in cpu_ids
    }
    return Snapshot(
        waiting=waiting, pools=pools, affinity=affinity, running=running, env_mem=lambda a: 4 * GIB
    )


GC_MODES = ("daemon", "plain", "frozen")


def run(
    repeat: int, order: str, rule: str = "priced", gc_mode: str = "daemon", cpu_time: bool = False
) -> dict:
    cfg = SchedConfig(order=order, rule=rule)  # type: ignore[arg-type]
    clock = time.thread_time if cpu_time else time.perf_counter
    gc_freeze = gc_mode == "frozen"
    if gc_mode == "daemon":  # tangramd/main.py: gc.collect(); gc.freeze() once it is ready
        gc.collect()
        gc.freeze()
    out = []
    for queued, units in CASES:
        snap = build(queued, units)
        schedule(snap, 0.0, cfg)  # warm-up
        if gc_freeze:  # long-lived state out of the cyclic GC's sight (its pauses are the tail)
            gc.collect()
            gc.freeze()
        times = []
        n = repeat if queued <= 1024 else max(10, repeat // 4)
        placed = 0
        for _ in range(n):
            t0 = clock()
            d = schedule(snap, 0.0, cfg)
            times.append((clock() - t0) * 1e3)
            placed = len(d.placements)
        times.sort()
        out.append(
            {
                "queued": queued,
                "units": units,
                "p50_ms": round(statistics.median(times), 3),
                "p99_ms": round(times[min(len(times) - 1, int(0.99 * len(times)))], 3),
                "placed": placed,
                "passes": n,
            }
        )
    if gc_mode != "plain":
        gc.unfreeze()
    clock_name = "thread_cpu" if cpu_time else "wall"
    return {
        "order": order,
        "rule": rule,
        "gc": gc_mode,
        "gc_freeze": gc_freeze,
        "clock": clock_name,
        "cases": out,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--order", default="fcfs", choices=["fcfs", "backfill"])
    ap.add_argument("--rule", default="priced", choices=["priced", "wait-eft", "wait", "paper"])
    ap.add_argument(
        "--gc",
        default="daemon",
        choices=GC_MODES,
        help="daemon: start-up objects frozen, as tangramd does (default); plain: nothing "
        "frozen; frozen: the built queue frozen too (the cyclic GC's whole share of p99)",
    )
    ap.add_argument("--gc-freeze", action="store_true", help="the same as --gc frozen")
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time passes with the thread's CPU clock (leaves out other processes' turns)",
    )
    args = ap.parse_args()
    gc_mode = "frozen" if args.gc_freeze else args.gc
    result = run(args.repeat, args.order, args.rule, gc_mode, args.cpu_time)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{'queued':>7} {'units':>6} {'p50 ms':>8} {'p99 ms':>8} {'placed':>7}")
        for c in result["cases"]:
            row = (c["queued"], c["units"], c["p50_ms"], c["p99_ms"], c["placed"])
            print("{:>7} {:>6} {:>8} {:>8} {:>7}".format(*row))


if __name__ == "__main__":
    main()
