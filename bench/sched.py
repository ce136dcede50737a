"""Latency of one full scheduling pass (candidates + greedy eviction + DP + objective).

Usage: python bench/sched.py [--json] [--repeat N] [--order fcfs|backfill]
       [--rule priced|wait-eft|wait|paper] [--gc daemon|plain|frozen] [--cpu-time]
       [--scale [--scale-repeat N]] [--curve] [--plot PATH] [--jobs N]

Each case builds a realistic mix over CPU node pools holding ``units`` free cores in total
(nodes of up to 256 cores, two NUMA nodes each), a 2-node GPU pool and one API endpoint:
~80% short non-elastic exec actions, ~12% elastic exec actions with 5-10 allowed amounts
and a profile, ~5% GPU service actions ({1,2,4,8} GPUs), ~3% API calls. Half of the
trajectories already have a node. Prints p50/p99 over ``--repeat`` passes.
``--gc`` is how the cyclic garbage collector sees the pass: ``daemon`` (the default) under
the daemon's own policy, by calling its functions (``tangramd/collector.py``): start-up
objects frozen once (``freeze_startup``), each pass run with the collector paused
(``schedule_paused``, what ``tangramd`` calls); ``plain`` freezes nothing and leaves the
collector on (its collections inside the pass walk the queue: the old tail); ``frozen``
(``--gc-freeze``) freezes the built queue too and leaves the collector on.
``--cpu-time`` times each pass with the thread's CPU clock instead of the wall clock: on a
shared machine it leaves out the time other processes hold the CPU (not cache effects).

``--scale`` adds the 10x cases (16,384 queued on 4,096 cores; 65,536 queued on 16,384 cores
on 128 nodes) to the same ``cases`` rows, timed over ``--scale-repeat`` passes (default 5).
Every row has ``goal_p99_ms`` where the case has a goal, and ``assign_p50_ms``: the part of
the pass spent choosing a node for trajectories without one (``_assign_nodes``, timed on
its own: the one phase that grows with queue x nodes). These rows time a *full* pass from
the snapshot: every core free, the whole queue to place (a cold start). They also have
``steady_p50_ms`` / ``steady_p99_ms``: the pass after one event in the queue's steady
state (passes carried out until one places nothing, then one running action finishes on
one node), with ``steady_queued`` actions still queued: what the daemon pays per event.
``--curve`` adds ``curves``: the pass's p50 as the queue grows (1k to 64k queued on 16,384
cores, 128 nodes) and as the cluster grows (1k to 16k cores on nodes of 128 cores, 16,384
queued), each with the slope of log(time) over log(size) (1: linear, 2: quadratic).
``--plot PATH`` draws the curves (implies ``--curve``; needs matplotlib).
``--jobs N`` spreads the queue over N jobs (weights 1, 2, 3, 1, ...; issue 34): each pass
then orders it by fair share (``tangram.sched.share``) before the per-pool rule.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangram import _native
from tangram.model import TrajectoryId, make_action
from tangram.pools.api import ApiPool
from tangram.pools.cpu import CpuNodePool
from tangram.pools.gpu import GpuCluster, GpuNodePool, ServiceSpec
from tangram.sched import SchedConfig, Snapshot, schedule
from tangram.sched.schedule import _assign_nodes  # timed on its own (the node-choice phase)
from tangram.sched.share import Job
from tangramd.collector import freeze_startup, paused, schedule_paused

CASES = [(64, 64), (256, 256), (1024, 256), (4096, 1024)]
# (queued, units, CPU nodes or None: nodes of up to 256 cores) -> p99 goal, ms
GOALS = {(64, 64, None): 1.0, (256, 256, None): 5.0, (4096, 1024, None): 25.0}
SCALE_CASES = [(16384, 4096, None), (65536, 16384, 128)]
GOALS.update({SCALE_CASES[0]: 50.0, SCALE_CASES[1]: 200.0})
# the curves: queued at fixed cores, then cores at a fixed queue (nodes of 128 cores)
CURVE_UNITS, CURVE_NODE_CORES, CURVE_QUEUED = 16384, 128, 16384
CURVE_QUEUE = [1024 << k for k in range(7)]  # 1k .. 64k
CURVE_CORES = [1024 << k for k in range(5)]  # 1k .. 16k
GIB = 1 << 30


def build(queued: int, units: int, seed: int = 0, nodes: int | None = None, jobs: int = 1):
    """``jobs`` > 1: action ``i`` belongs to job ``j{i % jobs}`` (weights 1, 2, 3, 1, ...;
    every job holds a few of the running cores), so each pass orders the queue by fair
    share (tangram.sched.share); the actions themselves are the same as with one job."""
    rng = random.Random(seed)
    n_nodes = nodes if nodes is not None else max(1, units // 256)
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
    if jobs <= 1:
        return Snapshot(
            waiting=waiting,
            pools=pools,
            affinity=affinity,
            running=running,
            env_mem=lambda a: 4 * GIB,
        )
    names = [f"j{k}" for k in range(jobs)]
    waiting = [replace(a, job=names[i % jobs]) for i, a in enumerate(waiting)]
    busy = sum(len(r) for r in running.values())
    return Snapshot(
        waiting=waiting,
        pools=pools,
        affinity=affinity,
        running=running,
        env_mem=lambda a: 4 * GIB,
        jobs={n: Job(n, weight=float(1 + k % 3)) for k, n in enumerate(names)},
        held={n: {"cpu": busy * (k + 1) // (jobs * (jobs + 1) // 2)} for k, n in enumerate(names)},
    )


GC_MODES = ("daemon", "plain", "frozen")


def _unplaced(snap: Snapshot) -> list:
    """The actions schedule() hands to _assign_nodes: exec actions of trajectories without
    a node, in queue order."""
    return [a for a in snap.waiting if a.kind == "exec" and a.trajectory not in snap.affinity]


def measure(
    queued: int,
    units: int,
    nodes: int | None,
    passes: int,
    cfg: SchedConfig,
    clock,
    gc_freeze: bool = False,
    daemon_gc: bool = True,
    steady: bool = False,
    jobs: int = 1,
) -> dict:
    """One case: p50/p99 of ``passes`` passes after a warm-up, and the node-choice phase's p50
    (``daemon_gc``: each through the daemon's collector policy, as tangramd runs a pass);
    ``steady``: also the pass after one event in the queue's steady state (``steady_*``)."""
    snap = build(queued, units, nodes=nodes, jobs=jobs)
    one = schedule_paused if daemon_gc else schedule
    one(snap, 0.0, cfg)  # warm-up
    if gc_freeze:  # long-lived state out of the cyclic GC's sight (its pauses are the tail)
        gc.collect()
        gc.freeze()
    times = []
    placed = 0
    for _ in range(passes):
        t0 = clock()
        d = one(snap, 0.0, cfg)
        times.append((clock() - t0) * 1e3)
        placed = len(d.placements)
    unplaced = _unplaced(snap)
    assign = []
    for _ in range(passes):
        if daemon_gc:
            with paused():
                t0 = clock()
                _assign_nodes(unplaced, snap, 0.0, cfg)
                assign.append((clock() - t0) * 1e3)
        else:
            t0 = clock()
            _assign_nodes(unplaced, snap, 0.0, cfg)
            assign.append((clock() - t0) * 1e3)
    times.sort()
    row = {
        "queued": queued,
        "units": units,
        "nodes": sum(1 for p in snap.pools if p.startswith("cpu:")),
        "p50_ms": round(statistics.median(times), 3),
        "p99_ms": round(times[min(len(times) - 1, int(0.99 * len(times)))], 3),
        "placed": placed,
        "passes": passes,
        **({"jobs": jobs} if jobs > 1 else {}),
        "assign_p50_ms": round(statistics.median(assign), 3),
    }
    if steady:
        sat, where = saturate(snap, cfg)
        row.update(measure_steady(sat, where, passes, cfg, clock, one))
    goal = GOALS.get((queued, units, nodes))
    if goal is not None:
        row["goal_p99_ms"] = goal
        row["meets_goal"] = row["p99_ms"] <= goal
    return row


def saturate(snap: Snapshot, cfg: SchedConfig) -> tuple[Snapshot, dict]:
    """The snapshot after passes until one places nothing, each pass's decision carried out
    as the daemon does (units allocated, an environment's memory reserved on its new node,
    the action running until its expected finish, placed and rejected actions off the
    queue): the queue's steady state, every pool full or its queue blocked. Also returns
    where each action placed runs (action id -> (pool id, its running entry))."""
    pools, affinity = snap.pools, dict(snap.affinity)
    running = {pid: list(r) for pid, r in snap.running.items()}
    waiting = list(snap.waiting)
    by_id = {a.id: a for a in waiting}
    where: dict = {}
    for _ in range(64):
        d = schedule(snap, 0.0, cfg)
        if not d.placements:
            break
        for p in d.placements:
            pools[p.pool_id].allocate(p.action_id, p.units)
            if p.new_node:
                a = by_id[p.action_id]
                pools[p.pool_id].reserve_mem(a.trajectory, snap.env_mem(a))
                affinity[a.trajectory] = p.pool_id
            entry = (p.expected_s, len(p.units))
            running.setdefault(p.pool_id, []).append(entry)
            where[p.action_id] = (p.pool_id, entry)
        gone = d.placed_ids() | {i.action_id for i in d.infeasible}
        waiting = [a for a in waiting if a.id not in gone]
        snap = Snapshot(
            waiting=waiting,
            pools=pools,
            affinity=affinity,
            running=running,
            env_mem=snap.env_mem,
        )
    return snap, where


def measure_steady(
    snap: Snapshot, where: dict, passes: int, cfg: SchedConfig, clock, one=schedule_paused
) -> dict:
    """The pass that follows one event in the steady state: one running action finishes
    (its units return to its pool, it leaves the running list), and the pass reads the
    whole queue again (the daemon's full pass; its short pass does not apply to this mix).
    Each of ``passes`` events is on another pool, undone after its pass."""
    by_pool: dict = {}
    for aid, (pid, entry) in where.items():
        if pid.startswith("cpu:"):
            by_pool.setdefault(pid, (aid, entry))
    events = sorted(by_pool.items())
    times, placed = [], []
    for k in range(passes):
        pid, (aid, entry) = events[(k * 37) % len(events)]
        pool = snap.pools[pid]
        units = pool.release(aid)
        run = list(snap.running[pid])
        run.remove(entry)
        left = dict(snap.running)
        left[pid] = run
        after = Snapshot(
            waiting=snap.waiting,
            pools=snap.pools,
            affinity=snap.affinity,
            running=left,
            env_mem=snap.env_mem,
        )
        t0 = clock()
        d = one(after, 0.0, cfg)
        times.append((clock() - t0) * 1e3)
        placed.append(len(d.placements))
        pool.allocate(aid, units)  # undone: the next event finds the same steady state
    times.sort()
    return {
        "steady_p50_ms": round(statistics.median(times), 3),
        "steady_p99_ms": round(times[min(len(times) - 1, int(0.99 * len(times)))], 3),
        "steady_queued": len(snap.waiting),
        "steady_placed": round(statistics.median(placed), 1),
    }


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) over log(x): the exponent k of y ~ x**k."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(max(y, 1e-9)) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly, strict=True)) / den if den else 0.0


def curve(
    points: list[tuple[int, int, int]],
    x: str,
    passes: int,
    cfg: SchedConfig,
    clock,
    daemon_gc: bool = True,
):
    """p50 of a pass at each (queued, units, nodes); the slopes over all points and over the
    upper half (where fixed per-pass costs no longer dominate)."""
    rows = [measure(q, u, n, passes, cfg, clock, daemon_gc=daemon_gc) for q, u, n in points]
    xs = [float(r[x]) for r in rows]
    out: dict = {"x": x, "points": rows}
    for key in ("p50_ms", "assign_p50_ms"):
        ys = [r[key] for r in rows]
        rest = [r["p50_ms"] - r["assign_p50_ms"] for r in rows]
        h = len(rows) // 2
        out[f"slope_{key}"] = round(slope(xs, ys), 2)
        out[f"slope_{key}_upper"] = round(slope(xs[h:], ys[h:]), 2)
    out["slope_rest_p50_ms"] = round(slope(xs, rest), 2)
    return out


def curves(
    passes: int,
    cfg: SchedConfig,
    clock,
    queue: list[int] = CURVE_QUEUE,
    cores: list[int] = CURVE_CORES,
    units: int = CURVE_UNITS,
    node_cores: int = CURVE_NODE_CORES,
    queued: int = CURVE_QUEUED,
    daemon_gc: bool = True,
) -> dict:
    """The pass's cost by queue length (``units`` cores on nodes of ``node_cores``) and by
    cluster size (``queued`` actions, nodes of ``node_cores``)."""
    nodes = max(1, units // node_cores)
    by_queue = curve([(q, units, nodes) for q in queue], "queued", passes, cfg, clock, daemon_gc)
    by_queue["fixed"] = {"units": units, "nodes": nodes}
    by_cores = curve(
        [(queued, u, max(1, u // node_cores)) for u in cores],
        "units",
        passes,
        cfg,
        clock,
        daemon_gc,
    )
    by_cores["fixed"] = {"queued": queued, "node_cores": node_cores}
    return {"queued": by_queue, "units": by_cores}


def plot(result: dict, path: str, before: dict | None = None, label: str = "before") -> None:
    """The curves of ``result`` (and, dimmed, those of ``before``: another run's) to PATH."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key in zip(axes, ("queued", "units"), strict=True):
        c = result["curves"][key]
        xs = [r[key] for r in c["points"]]
        if before is not None:
            b = before["curves"][key]["points"]
            bx = [r[key] for r in b]
            ax.loglog(bx, [r["p50_ms"] for r in b], "o-", color="0.7", label=f"whole ({label})")
            ax.loglog(
                bx, [r["assign_p50_ms"] for r in b], "s--", color="0.7",
                label=f"node choice ({label})",
            )  # fmt: skip
        ax.loglog(xs, [r["p50_ms"] for r in c["points"]], "o-", label="whole pass")
        ax.loglog(xs, [r["assign_p50_ms"] for r in c["points"]], "s--", label="node choice")
        rest = [max(r["p50_ms"] - r["assign_p50_ms"], 1e-3) for r in c["points"]]
        ax.loglog(xs, rest, "^:", label="the rest (routing, per-pool passes)")
        f = c["fixed"]
        if key == "queued":
            title = f"by queue: {f['units']:,} cores on {f['nodes']} nodes"
        else:
            title = f"by cores: {f['queued']:,} queued, nodes of {f['node_cores']} cores"
        ax.set_title(f"{title} (slope {c['slope_p50_ms']})", fontsize=9)
        ax.set_xlabel("queued actions" if key == "queued" else "free cores")
        ax.set_ylabel("p50 ms per pass")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    clock = "thread CPU" if result["clock"] == "thread_cpu" else "wall"
    core = "compiled" if result.get("compiled") else "interpreted"
    fig.suptitle(f"bench/sched.py --curve: one scheduling pass ({core} core, {clock} clock)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(
    repeat: int,
    order: str,
    rule: str = "priced",
    gc_mode: str = "daemon",
    cpu_time: bool = False,
    scale: bool = False,
    scale_repeat: int = 5,
    with_curves: bool = False,
    cases: list | None = None,
    scale_cases: list | None = None,
    curve_spec: dict | None = None,
    jobs: int = 1,
) -> dict:
    cfg = SchedConfig(order=order, rule=rule)  # type: ignore[arg-type]
    clock = time.thread_time if cpu_time else time.perf_counter
    gc_freeze = gc_mode == "frozen"
    daemon_gc = gc_mode == "daemon"
    if daemon_gc:  # as tangramd/main.py once it is ready (tangramd/collector.py)
        freeze_startup()
    out = []
    for queued, units in CASES if cases is None else cases:
        n = repeat if queued <= 1024 else max(10, repeat // 4)
        out.append(measure(queued, units, None, n, cfg, clock, gc_freeze, daemon_gc, jobs=jobs))
    if scale:
        for queued, units, nodes in SCALE_CASES if scale_cases is None else scale_cases:
            out.append(
                measure(queued, units, nodes, scale_repeat, cfg, clock, gc_freeze, daemon_gc, True)
            )
    result = {
        "order": order,
        "rule": rule,
        "gc": gc_mode,
        "gc_freeze": gc_freeze,
        "clock": "thread_cpu" if cpu_time else "wall",
        "compiled": _native.ACTIVE,
        "cases": out,
    }
    if with_curves:
        spec = {"daemon_gc": daemon_gc, **(curve_spec or {})}
        result["curves"] = curves(scale_repeat, cfg, clock, **spec)
    if gc_mode != "plain":
        gc.unfreeze()
    return result


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
        help="daemon: the daemon's collector policy (tangramd/collector.py: start-up objects "
        "frozen, each pass with the collector paused; default); plain: nothing frozen, "
        "collector on; frozen: the built queue frozen too, collector on",
    )
    ap.add_argument("--gc-freeze", action="store_true", help="the same as --gc frozen")
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time passes with the thread's CPU clock (leaves out other processes' turns)",
    )
    ap.add_argument(
        "--scale",
        action="store_true",
        help="add the 10x cases (16,384 queued on 4,096 cores; 65,536 on 16,384 cores, 128 nodes)",
    )
    ap.add_argument(
        "--scale-repeat",
        type=int,
        default=5,
        help="passes per big case and per curve point (default 5; each 64k pass is ~0.3 s)",
    )
    ap.add_argument(
        "--curve",
        action="store_true",
        help="add the cost curves: queued 1k-64k on 16,384 cores (128 nodes), and cores "
        "1k-16k (nodes of 128 cores) at 16,384 queued",
    )
    ap.add_argument("--plot", metavar="PATH", help="draw the curves to PATH (implies --curve)")
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="spread the queue over N jobs (fair share across jobs, issue 34; default 1)",
    )
    args = ap.parse_args()
    for name in ("repeat", "scale_repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    gc_mode = "frozen" if args.gc_freeze else args.gc
    result = run(
        args.repeat,
        args.order,
        args.rule,
        gc_mode,
        args.cpu_time,
        scale=args.scale,
        scale_repeat=args.scale_repeat,
        with_curves=args.curve or bool(args.plot),
        jobs=args.jobs,
    )
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
        return
    head = f"{'queued':>7} {'units':>6} {'nodes':>5} {'p50 ms':>8} {'p99 ms':>8} {'goal':>6} "
    print(head + f"{'assign':>7} {'placed':>7}")
    for c in result["cases"]:
        goal = c.get("goal_p99_ms", "-")
        row = (c["queued"], c["units"], c["nodes"], c["p50_ms"], c["p99_ms"], goal)
        print("{:>7} {:>6} {:>5} {:>8} {:>8} {:>6} ".format(*row), end="")
        print(f"{c['assign_p50_ms']:>7} {c['placed']:>7}")
    for key, c in result.get("curves", {}).items():
        print(
            f"curve by {key} (fixed {c['fixed']}): slope {c['slope_p50_ms']} "
            f"(upper half {c['slope_p50_ms_upper']}), node choice {c['slope_assign_p50_ms']}"
        )
        for r in c["points"]:
            print(f"  {r[key]:>7} {r['p50_ms']:>9} ms  (node choice {r['assign_p50_ms']} ms)")


if __name__ == "__main__":
    main()
