"""Random scheduling snapshots, and the decisions one process makes on them.

``tests/test_native.py`` runs ``decisions`` in two processes, one on the compiled core and
one on its sources (``TANGRAM_PURE=1``), and compares the text: the same placements, units,
expected durations, waiting lists, shortfalls, objective and eviction count, to the last
bit of every float (``repr``).

Each snapshot mixes what a pass meets: CPU nodes of several sizes and NUMA layouts with
units taken and work running, a GPU cluster with services, an API endpoint; fixed, elastic
(ranges and sets, profiled or not) and estimated exec actions, service calls at several GPU
sets, API calls, trajectories with and without a node, recent load per node, and a ``now``
before or past the starvation bound. Configurations cycle through every rule and order and
depths 1 to 3.
"""

from __future__ import annotations

import random

from tangram.model import ActionId, TrajectoryId, make_action
from tangram.pools.api import ApiPool
from tangram.pools.cpu import CpuNodePool
from tangram.pools.gpu import GpuCluster, GpuNodePool, ServiceSpec
from tangram.sched import PoolLoad, SchedConfig, Snapshot, schedule

GIB = 1 << 30
RULES = ("priced", "wait-eft", "wait", "paper")
ORDERS = ("fcfs", "backfill")


def snapshot(seed: int) -> tuple[Snapshot, float]:
    """A random snapshot and the ``now`` of its pass."""
    rng = random.Random(seed)
    pools: dict[str, object] = {}
    cpu_ids: list[str] = []
    running: dict[str, list[tuple[float, int]]] = {}
    load: dict[str, PoolLoad] = {}
    for n in range(rng.randint(1, 3)):
        cores = rng.choice([4, 8, 16, 32, 64])
        numa = rng.choice([1, 2]) if cores >= 8 else 1
        per = cores // numa
        pool = CpuNodePool(
            f"n{n}", [list(range(i * per, (i + 1) * per)) for i in range(numa)], 64 * GIB
        )
        busy = rng.randint(0, cores // 2)
        if busy:
            pool.allocate(ActionId(f"busy{n}"), tuple(range(busy)))
            running[pool.pool_id] = [(rng.uniform(-1.0, 90.0), 1) for _ in range(busy)]
        if rng.random() < 0.7:
            load[pool.pool_id] = PoolLoad(
                elastic_per_s=rng.uniform(0, 0.5),
                short_units=rng.uniform(0, cores / 4),
                elastic_running=rng.randint(0, 3),
                elastic_units=rng.randint(0, busy),
                elastic_starts_per_s=rng.uniform(0, 0.3),
                elastic_mean_s=rng.uniform(0, 120),
            )
        pools[pool.pool_id] = pool
        cpu_ids.append(pool.pool_id)
    gpu_nodes = [
        GpuNodePool(f"g{i}", 8, mem_per_gpu=80 * GIB, h2d_bytes_per_s=25e9)
        for i in range(rng.randint(1, 2))
    ]
    services = {f"judge{k}": ServiceSpec(f"judge{k}", 30 * GIB) for k in range(3)}
    gpu = GpuCluster(gpu_nodes, services)
    if rng.random() < 0.5:
        gpu.allocate(ActionId("busy-gpu"), (0, 1))
    pools[gpu.pool_id] = gpu
    api = ApiPool("search", concurrency=rng.randint(1, 8), quota=0, period_s=60.0)
    pools[api.pool_id] = api
    now = rng.choice([0.0, 5.0, 45.0])
    affinity: dict[TrajectoryId, str] = {}
    waiting = []
    for i in range(rng.randint(1, 60)):
        traj = f"t{i}"
        if rng.random() < 0.6:
            affinity[TrajectoryId(traj)] = rng.choice(cpu_ids)
        at = rng.uniform(0.0, now)
        r = rng.random()
        if r < 0.55:
            dur = rng.choice([None, rng.uniform(0.001, 5.0)])
            cpus = rng.choice([1, 1, 1, 2, 4])
            a = make_action(
                f"a{i}",
                "exec",
                traj,
                {"cpu": cpus},
                seq=i,
                dur_s=dur,
                klass="tool",
                submitted_at=at,
            )
        elif r < 0.8:
            hi = rng.choice([2, 4, 8, 16, 32])
            eff = {
                m: round(max(0.2, 1.0 - rng.uniform(0, 0.1) * (m - 1)), 4)
                for m in (1, 2, 4, 8, 16, 32)
                if m <= hi
            }
            demand: object = (
                [1, hi]
                if rng.random() < 0.6
                else {"set": sorted(rng.sample(range(1, hi + 1), min(hi, rng.randint(2, 5))))}
            )
            a = make_action(
                f"a{i}",
                "exec",
                traj,
                {"cpu": demand},
                seq=i,
                t1_s=rng.uniform(5, 400),
                eff=eff,
                submitted_at=at,
            )
        elif r < 0.92:
            a = make_action(
                f"a{i}",
                "service",
                traj,
                {"gpu": {"set": [1, 2, 4, 8]}},
                seq=i,
                service=f"judge{rng.randrange(3)}",
                t1_s=rng.uniform(1, 20),
                eff={1: 1.0, 2: 0.9, 4: 0.75, 8: 0.55},
                submitted_at=at,
            )
        else:
            a = make_action(
                f"a{i}", "api", traj, {"api:search": 1}, seq=i, dur_s=1.2, submitted_at=at
            )
        waiting.append(a)
    snap = Snapshot(
        waiting=waiting,
        pools=pools,  # type: ignore[arg-type]
        affinity=affinity,
        running=running,
        estimate=lambda klass: 0.7 if klass == "tool" else 1.0,
        env_mem=lambda action: 4 * GIB,
        load=load,
    )
    return snap, now


def config(seed: int) -> SchedConfig:
    return SchedConfig(
        rule=RULES[seed % 4],  # type: ignore[arg-type]
        order=ORDERS[(seed // 4) % 2],  # type: ignore[arg-type]
        depth=1 + (seed // 8) % 3,
    )


def decisions(seeds: range) -> list[str]:
    """``repr`` of each seed's decision, with the core this process imported."""
    out = []
    for seed in seeds:
        snap, now = snapshot(seed)
        out.append(repr(schedule(snap, now, config(seed))))
    return out
