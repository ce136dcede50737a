"""Why the test runs' goal and the all-actions goal collide at high load (issue 34, item 5).

Usage: python bench/paper/elastic_frontier.py [--workload ai-coding] [--batch 2048] [--seed 0]
       [--policies tangram,fixed-dop:4,fixed-dop:8,fixed-dop:16] [--json] [--save]

On one generated trace (``--workload``: ``ai-coding`` on config/cluster-paper.toml, or a
mixed workload on config/cluster-mixed.toml), three things:

1. ``frontier``: the least core-seconds the trace's test runs need for a given mean run
   time, with no queue at all. Every choice of one allowed amount ``k`` per test run gives
   a total run time and a total of core-seconds ``k · t(k)``; the lower convex hull of all
   those choices (``Hull``: the Minkowski sum of each run's own hull, its edges merged by
   slope) is a lower bound on the core-seconds of any schedule whose test runs run that
   long on average (``least_core_s``), exact at its vertices. The table shows the hull's
   points at prices ``λ`` (``LAMBDAS``, core-seconds per second of run time): every test run
   at the amount that minimises ``(k + λ) · t(k)``. Pure arithmetic on the trace's speed-ups.
2. ``policies``: each policy's run split as ``avg ACT = run + wait`` (means over all
   actions), the test runs' mean run time and their core-seconds against the frontier's
   least at that mean run time (``excess``), and where the wait went: per trajectory, in
   its tool calls and in its test runs.
3. ``goal``: the goals in those terms. ``best_all`` is the fixed DoP with the least avg ACT
   over all actions (avg ``A``), ``best_test`` the one with the least test-run avg ACT
   (``T``). The all-actions avg is ``R + s · x + W``: ``R`` the other actions' mean run
   time (fixed by the trace: 1-core calls), ``s`` the test runs' fraction of the actions,
   ``x`` their mean run time, ``W`` the mean wait. Both goals at once need, for some ``x``,
   ``W <= A - R - s · x`` and the test runs' mean wait ``<= T - x``; the ``budget`` rows give
   both at the frontier's points, next to the least core-seconds that ``x`` takes.

Prints a markdown summary (``--json``: one object). ``--save`` also stores the object in
``bench/paper/out/elastic_frontier.json`` (``{"rows": [...]}``), replacing the row of the same
workload, batch and seed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from common import ROOT, action_kind, is_test, paper_cluster

from tangram.sim import generate, load_cluster, parse_policy
from tangram.sim.cluster import ClusterSpec
from tangram.sim.engine import Engine
from tangram.sim.metrics import ActionRecord
from tangram.sim.policy import PolicyError
from tangram.sim.trace import Trajectory

SAVED = common.OUT / "elastic_frontier.json"
LAMBDAS = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 20, 24, 32, 48, 64, 128, 4096)
POLICIES = "tangram,fixed-dop:4,fixed-dop:8,fixed-dop:16"
WORKLOADS = ("ai-coding", "coding+search", "mixed")

Table = list[tuple[int, float]]  # one test run's (amount, run time) for every allowed amount


def cluster_of(workload: str) -> ClusterSpec:
    """AI coding runs on the paper's testbed, the mixed workloads on the 4 × 64-core one."""
    if workload == "ai-coding":
        return paper_cluster()
    return load_cluster(ROOT / "config" / "cluster-mixed.toml")


def test_runs(trace: Sequence[Trajectory]) -> list[Table]:
    """Every test run of the trace: its run times."""
    return [
        [(k, a.true_duration(k)) for k in a.template.allowed_units()]
        for t in trace
        for a in t.actions()
        if is_test(a)
    ]


def run_policy(
    cluster: ClusterSpec, trace: Sequence[Trajectory], policy: str
) -> tuple[dict[str, Any], list[ActionRecord]]:
    """One policy's run on the trace: ``decompose``'s row with the p99, and the records."""
    engine = Engine(cluster, trace, parse_policy(policy))
    result = engine.run()
    row = decompose(engine.records, len(trace))
    row["p99_act_s"] = result.summary["p99_act_s"]
    return row, engine.records


def frontier(runs: Sequence[Table], lambdas: Sequence[float] = LAMBDAS) -> list[dict[str, float]]:
    """Per ``λ``: every run at its ``argmin_k (k + λ) · t(k)``; the mean run time, mean amount
    and total core-seconds (module doc). Ordered by ``λ``: run time falls, core-seconds rise."""
    out = []
    n = len(runs)
    for lam in sorted(lambdas):
        x = cs = kk = 0.0
        for table in runs:
            k, d = min(table, key=lambda kd: ((kd[0] + lam) * kd[1], kd[0]))
            x += d
            cs += k * d
            kk += k
        out.append(
            {
                "lambda": lam,
                "mean_run_s": round(x / n, 4),
                "mean_units": round(kk / n, 3),
                "core_s": round(cs, 1),
            }
        )
    return out


class Hull:
    """The lower convex hull of (total run time, total core-seconds) over every choice of one
    amount per test run, from the fastest choice to the cheapest (module doc, 1)."""

    def __init__(self, runs: Sequence[Table]) -> None:
        self.n = len(runs)
        x = c = 0.0
        edges: list[tuple[float, float, float]] = []  # (slope, run time, core-seconds)
        for table in runs:
            pts: list[tuple[float, float]] = []
            for t, cs in sorted((d, k * d) for k, d in table):
                if pts and t == pts[-1][0]:
                    continue  # the same run time on more units: never cheaper
                while len(pts) >= 2 and _turn(pts[-2], pts[-1], (t, cs)) <= 0.0:
                    pts.pop()
                pts.append((t, cs))
            cheapest = min(range(len(pts)), key=lambda i: (pts[i][1], pts[i][0]))
            pts = pts[: cheapest + 1]  # past the cheapest choice, slower costs more
            x += pts[0][0]
            c += pts[0][1]
            for (t0, c0), (t1, c1) in itertools.pairwise(pts):
                edges.append(((c1 - c0) / (t1 - t0), t1 - t0, c1 - c0))
        edges.sort()
        self.vertices = [(x, c)]
        for _, dx, dc in edges:
            x += dx
            c += dc
            self.vertices.append((x, c))

    def least_core_s(self, mean_run_s: float) -> float | None:
        """The least core-seconds at that mean run time; None below the fastest choice's."""
        total = mean_run_s * self.n
        vs = self.vertices
        if total < vs[0][0]:  # (a mean rounded to 4 places may fall just short of it)
            return vs[0][1] if total >= vs[0][0] - 1e-4 * self.n else None
        for (x0, c0), (x1, c1) in itertools.pairwise(vs):
            if total <= x1:
                return c0 + (c1 - c0) * (total - x0) / (x1 - x0)
        return vs[-1][1]  # slower than the cheapest choice: its core-seconds


def _turn(o: tuple[float, float], a: tuple[float, float], b: tuple[float, float]) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def least_core_s(runs: Sequence[Table], mean_run_s: float) -> float | None:
    """The least core-seconds of any choice of amounts whose test runs run ``mean_run_s`` on
    average (the lower convex hull: a bound, exact at its vertices); None where no choice is
    that fast."""
    return Hull(runs).least_core_s(mean_run_s)


def decompose(records: Sequence[ActionRecord], trajectories: int) -> dict[str, Any]:
    """avg ACT = run + wait over all completed actions; the test runs' and tool calls' parts."""
    done = [r for r in records if not r.failed]
    n = len(done)
    test = [r for r in done if action_kind(r) == "test"]
    tool = [r for r in done if action_kind(r) == "tool"]
    other = [r for r in done if action_kind(r) != "test"]

    def mean(xs: list[float]) -> float:
        return statistics.fmean(xs) if xs else 0.0

    return {
        "actions": n,
        "avg_act_s": round(mean([r.act_s for r in done]), 4),
        "run_s": round(mean([r.exec_s for r in done]), 4),
        "wait_s": round(mean([r.act_s - r.exec_s for r in done]), 4),
        "other_run_s": round(sum(r.exec_s for r in other) / n, 4) if n else 0.0,
        "test_fraction": round(len(test) / n, 6) if n else 0.0,
        "test_avg_act_s": round(mean([r.act_s for r in test]), 4),
        "test_run_s": round(mean([r.exec_s for r in test]), 4),
        "test_wait_s": round(mean([r.act_s - r.exec_s for r in test]), 4),
        "test_units": round(mean([float(r.units) for r in test]), 3),
        "test_core_s": round(sum(r.units * r.exec_s for r in test), 1),
        "tool_avg_act_s": round(mean([r.act_s for r in tool]), 4),
        "tool_wait_s": round(mean([r.act_s - r.exec_s for r in tool]), 4),
        "wait_per_trajectory_s": {
            "tool": round(sum(r.act_s - r.exec_s for r in tool) / trajectories, 3),
            "test": round(sum(r.act_s - r.exec_s for r in test) / trajectories, 3),
        },
    }


def measure(workload: str, batch: int, seed: int, policies: Sequence[str]) -> dict[str, Any]:
    if workload not in WORKLOADS:
        raise ValueError(f"workload: expected one of {', '.join(WORKLOADS)}, got {workload!r}")
    cluster = cluster_of(workload)
    trace = generate(workload, cluster, batch, seed=seed)
    runs = test_runs(trace)
    if not runs:
        raise ValueError(f"workload {workload!r} has no test runs (elastic exec, tag reward)")
    points = frontier(runs)
    hull = Hull(runs)
    rows: dict[str, dict[str, Any]] = {}
    for name in policies:
        t0 = time.perf_counter()
        row, _ = run_policy(cluster, trace, name)
        least = hull.least_core_s(row["test_run_s"])
        row["least_test_core_s"] = None if least is None else round(least, 1)
        row["test_core_s_excess"] = (
            None if least is None else round(row["test_core_s"] / least - 1.0, 4)
        )
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        rows[name] = row
        print(f"  [{workload} b={batch} {name}: {row['wall_s']} s]", file=sys.stderr)
    out: dict[str, Any] = {
        "workload": workload,
        "batch": batch,
        "seed": seed,
        "test_runs": len(runs),
        "frontier": points,
        "policies": rows,
    }
    fixed = [p for p in rows if p.startswith("fixed-dop:")]
    if fixed:
        out["goal"] = goal(rows, fixed, points)
    return out


def goal(
    rows: dict[str, dict[str, Any]], fixed: list[str], points: Sequence[dict[str, float]]
) -> dict[str, Any]:
    """The two goals as a wait budget and a test-run queue budget at each frontier point."""
    best_all = min(fixed, key=lambda p: rows[p]["avg_act_s"])
    best_test = min(fixed, key=lambda p: rows[p]["test_avg_act_s"])
    a, t = rows[best_all]["avg_act_s"], rows[best_test]["test_avg_act_s"]
    any_row = next(iter(rows.values()))
    r, s = any_row["other_run_s"], any_row["test_fraction"]
    budget = [
        {
            "mean_run_s": p["mean_run_s"],
            "least_test_core_s": p["core_s"],
            "wait_budget_s": round(a - r - s * p["mean_run_s"], 4),
            "test_wait_budget_s": round(t - p["mean_run_s"], 4),
        }
        for p in points
        if p["mean_run_s"] <= t
    ]
    return {
        "best_all": best_all,
        "all_avg_goal_s": a,
        "best_test": best_test,
        "test_avg_goal_s": t,
        "other_run_s": r,
        "test_fraction": s,
        "budget": budget,
    }


def save(row: dict[str, Any], path: Path) -> None:
    """Put ``row`` into ``path``'s rows in place of the one with its workload, batch and seed."""
    key = (row["workload"], row["batch"], row["seed"])
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    rows = [r for r in rows if (r["workload"], r["batch"], r["seed"]) != key] + [row]
    rows.sort(key=lambda r: (WORKLOADS.index(r["workload"]), r["batch"], r["seed"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": rows}, indent=1) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="ai-coding", choices=WORKLOADS)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=POLICIES, help=f"comma-separated (default {POLICIES})")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save", action="store_true", help=f"store the result in {SAVED.name}")
    args = ap.parse_args(argv)
    if args.batch <= 0:
        ap.error(f"--batch: expected a positive integer, got {args.batch}")
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        try:
            parse_policy(p)
        except PolicyError as e:
            ap.error(f"--policies: {e}")
    t0 = time.perf_counter()
    out = measure(args.workload, args.batch, args.seed, policies)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.save:
        save(out, SAVED)
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{args.workload}, batch {args.batch}, seed {args.seed}: {out['test_runs']} test runs")
    print("\n| λ | mean run (s) | mean units | least core-s |\n|---|---|---|---|")
    for p in out["frontier"]:
        print(f"| {p['lambda']} | {p['mean_run_s']} | {p['mean_units']} | {p['core_s']:.0f} |")
    print(
        "\n| policy | avg ACT = run + wait | test ACT (wait + run) | test core-s "
        "(over least) | tool ACT (wait) | wait per trajectory: tools / test |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in out["policies"].items():
        ex = r["test_core_s_excess"]
        print(
            f"| {name} | {r['avg_act_s']} = {r['run_s']} + {r['wait_s']} "
            f"| {r['test_avg_act_s']} ({r['test_wait_s']} + {r['test_run_s']}) "
            f"| {r['test_core_s']:.0f} ({'n/a' if ex is None else f'{ex:+.1%}'}) "
            f"| {r['tool_avg_act_s']} ({r['tool_wait_s']}) "
            f"| {r['wait_per_trajectory_s']['tool']} / {r['wait_per_trajectory_s']['test']} |"
        )
    g = out.get("goal")
    if g:
        print(
            f"\ngoals: all-actions avg <= {g['all_avg_goal_s']} ({g['best_all']}), test runs "
            f"<= {g['test_avg_goal_s']} ({g['best_test']}); other actions' run "
            f"{g['other_run_s']} s, test runs {g['test_fraction']:.2%} of the actions"
        )
        print("\n| test run mean (s) | least core-s | wait budget (s) | test wait budget (s) |")
        print("|---|---|---|---|")
        for b in g["budget"]:
            print(
                f"| {b['mean_run_s']} | {b['least_test_core_s']:.0f} | {b['wait_budget_s']} "
                f"| {b['test_wait_budget_s']} |"
            )
    print(f"\nwall {out['wall_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
