"""The simulator at 10× (issue 36 goal 4): wall time of AI coding, batch 20,480 on 40 × 64 cores.

Usage: python bench/paper/sim_scale.py [--scale 10] [--policies tangram,k8s,...] [--seed 0]
                                       [--passes all|touched|all,touched]
                                       [--profile FILE] [--json]

Scale ``s`` runs AI coding at batch ``2048·s`` on ``4·s`` CPU nodes of 64 cores (2 NUMA nodes,
512 GB each, as ``config/cluster-mixed.toml``'s); the GPU nodes, services and APIs are those of
``config/cluster-mixed.toml`` (AI coding uses none of them). ``--scale 10`` is the goal's case
(batch 20,480 on 40 × 64 = 2,560 cores); ``--scale 0.25`` (batch 512 on 1 node) is the smoke
test. One simulation per policy, one after the other in this process, on the same trace; the
JSON gives each policy's wall seconds (``wall_s``, not deterministic; ``cpu_s``, the process's
CPU seconds, is less sensitive to other work on a shared machine), the scheduler passes it
made and the simulated results (avg ACT, step time, makespan: deterministic for a seed), and
whether the core ran compiled. Goal: ``wall_s`` ≤ 120 s per policy at scale 10.

``--passes`` chooses which CPU nodes' queues a scheduling pass runs while trajectories wait
for a node (``tangram.sim.engine``): ``all`` (the default, the simulator's default) or
``touched`` (only those whose state changed). ``--passes all,touched`` runs each policy under
both, keys the rows ``policy@mode`` and adds ``touched_vs_all``: per policy, touched's avg
ACT, p99 ACT, makespan, step time, CPU seconds and passes over all's (1.0: the same), and
``goal_met_by_passes``.

``--profile FILE`` runs the policies under cProfile and writes the stats there (``pstats``).
``--cap-s S`` stops a policy's run after S wall seconds: its row says ``"finished": false``,
how far it got (simulated seconds, trajectories done) and the wall time (a lower bound).
Progress goes to stderr every 30 s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from common import ROOT, load_cluster

from tangram.sim import generate, parse_policy
from tangram.sim.cluster import ClusterSpec, CpuNodeSpec
from tangram.sim.engine import PASSES, Engine

POLICIES = ("tangram", "tangram-eft", "k8s", "baseline")
GOAL_S = 120.0


def scale_cluster(scale: float, nodes: int | None = None, mem_gb: float = 512.0) -> ClusterSpec:
    """``4·scale`` nodes (or ``nodes``) of 64 cores / ``mem_gb`` next to cluster-mixed's GPUs."""
    base = load_cluster(ROOT / "config" / "cluster-mixed.toml")
    nodes = nodes or max(1, round(4 * scale))
    node = CpuNodeSpec(count=nodes, cores=64, numa=2, mem_gb=mem_gb)
    return replace(base, cpu_nodes=(node,))


def compiled() -> bool:
    """Whether the scheduling core runs compiled (mypyc) rather than from its sources."""
    from tangram import _native

    return bool(_native.ACTIVE)


class _Cap(Exception):
    """The run passed its wall-time cap."""


def run_one(
    cluster: ClusterSpec,
    trace: list[Any],
    name: str,
    cap_s: float | None = None,
    passes: str = "all",
) -> dict[str, Any]:
    seen = {"now": 0.0, "done": 0, "total": len(trace), "shown": 0.0}
    t0 = time.perf_counter()

    def progress(now: float, done: int, total: int) -> None:
        wall = time.perf_counter() - t0
        seen.update(now=now, done=done)
        if wall - seen["shown"] >= 30.0:
            seen["shown"] = wall
            print(
                f"  {name}: {wall:.0f}s wall, t={now:,.0f}s simulated, "
                f"{done}/{total} trajectories, {eng.passes} passes",
                file=sys.stderr,
                flush=True,
            )
        if cap_s is not None and wall > cap_s:
            raise _Cap

    eng = Engine(cluster, trace, parse_policy(name), progress=progress, passes=passes)
    c0 = time.process_time()
    try:
        t0 = time.perf_counter()
        res = eng.run()
        wall = time.perf_counter() - t0
    except _Cap:
        # not finished: how far it got (the wall time is a lower bound)
        return {
            "finished": False,
            "wall_s": round(time.perf_counter() - t0, 2),
            "cpu_s": round(time.process_time() - c0, 2),
            "passes": eng.passes,
            "simulated_s": round(seen["now"], 1),
            "trajectories_done": seen["done"],
            "trajectories": seen["total"],
        }
    s = res.summary
    return {
        "finished": True,
        "wall_s": round(wall, 2),
        "cpu_s": round(time.process_time() - c0, 2),
        "passes": eng.passes,
        "actions": s["actions"],
        "failed": s["failed"],
        "avg_act_s": s["avg_act_s"],
        "p99_act_s": s["p99_act_s"],
        "step_s": s["step_s"],
        "makespan_s": s["makespan_s"],
    }


def met(rows: Iterable[dict[str, Any]]) -> bool:
    """The goal: every run finished within ``GOAL_S`` of wall time."""
    return all(r["finished"] and r["wall_s"] <= GOAL_S for r in rows)


def compare(rows: dict[str, dict[str, Any]], name: str) -> dict[str, float | None]:
    """``name``'s run under ``passes="touched"`` over its run under ``"all"``: the ratio of
    each simulated result (1.0: the same) and of the CPU seconds (None where a run did not
    finish)."""
    a, t = rows[f"{name}@all"], rows[f"{name}@touched"]
    out: dict[str, float | None] = {}
    for f in ("avg_act_s", "p99_act_s", "makespan_s", "step_s", "cpu_s", "passes"):
        x, y = a.get(f), t.get(f)
        ok = a["finished"] and t["finished"] and x and y is not None
        out[f] = round(y / x, 4) if ok else None
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=10.0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, help="override the batch (default 2048 x scale)")
    ap.add_argument("--nodes", type=int, help="override the node count (default 4 x scale)")
    ap.add_argument(
        "--mem-gb", type=float, default=512.0, help="memory per node (GB; 4 GB per environment)"
    )
    ap.add_argument("--profile", metavar="FILE")
    ap.add_argument(
        "--cap-s",
        type=float,
        metavar="S",
        help="stop a policy's run after S wall seconds and report how far it got",
    )
    ap.add_argument(
        "--passes",
        default="all",
        metavar="MODE[,MODE]",
        help="which CPU node queues a pass runs while trajectories wait node-less (all: "
        "every node's, the default; touched: those whose state changed); two modes run "
        "each policy under both and compare them (touched_vs_all)",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    modes = args.passes.split(",")
    for mode in modes:
        if mode not in PASSES:
            ap.error(f"--passes: {mode!r} is not one of {', '.join(PASSES)}")
    cluster = scale_cluster(args.scale, args.nodes, args.mem_gb)
    batch = args.batch or max(1, round(2048 * args.scale))
    t0 = time.perf_counter()
    trace = generate("ai-coding", cluster, batch, seed=args.seed)
    gen_s = time.perf_counter() - t0
    nodes = cluster.cpu_nodes[0].count
    doc: dict[str, Any] = {
        "workload": "ai-coding",
        "batch": batch,
        "seed": args.seed,
        "cpu_nodes": nodes,
        "cores": nodes * 64,
        "mem_gb_per_node": args.mem_gb,
        "trace_actions": sum(1 for t in trace for _ in t.actions()),
        "generate_s": round(gen_s, 2),
        "compiled": compiled(),
        "passes": modes,
        "goal_s": GOAL_S,
        "policies": {},
    }
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
    names = args.policies.split(",")
    for name in names:
        for mode in modes:
            if prof is not None:
                prof.enable()
            row = run_one(cluster, trace, name, args.cap_s, mode)
            if prof is not None:
                prof.disable()
            key = name if len(modes) == 1 else f"{name}@{mode}"
            doc["policies"][key] = row
            print(f"  [{key}: {row['wall_s']:.1f}s wall, {row['passes']} passes]", file=sys.stderr)
    if prof is not None:
        prof.dump_stats(args.profile)
    rows = doc["policies"]
    doc["max_wall_s"] = max(r["wall_s"] for r in rows.values())
    doc["goal_met"] = met(rows.values())
    if len(modes) > 1:
        doc["goal_met_by_passes"] = {
            mode: met(rows[f"{n}@{mode}"] for n in names) for mode in modes
        }
        if {"all", "touched"} <= set(modes):
            doc["touched_vs_all"] = {n: compare(doc["policies"], n) for n in names}
    if args.json:
        print(json.dumps(doc, indent=1))
    else:
        print(f"ai-coding batch {batch} on {nodes} x 64 cores (compiled core: {doc['compiled']})")
        print("| policy | wall s | passes | avg ACT s | step s |")
        print("|---|---|---|---|---|")
        for name, r in doc["policies"].items():
            if not r["finished"]:
                print(
                    f"| {name} | > {r['wall_s']:.0f} (stopped at t={r['simulated_s']:.0f}s, "
                    f"{r['trajectories_done']}/{r['trajectories']} done) | {r['passes']} | | |"
                )
                continue
            print(
                f"| {name} | {r['wall_s']:.1f} | {r['passes']} | {r['avg_act_s']:.2f} | "
                f"{r['step_s']:.0f} |"
            )
    return doc


if __name__ == "__main__":
    main()
