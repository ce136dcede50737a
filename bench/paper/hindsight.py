"""A feasible hindsight oracle for the test runs (issue 34, item 5): how low their avg ACT can
go, with each one's DoP chosen knowing the whole run, while the all-actions goal holds.

Usage: python bench/paper/hindsight.py [--workload ai-coding] [--batch 2048] [--seed 0]
       [--window 60] [--prices 4,8,12,16,24,32] [--amounts 8,12,16] [--sweeps 4]
       [--workers 2] [--json] [--save]

fig9's ``oracle`` gives each test run the DoP of the run in which it finished soonest. That
is not a schedule: the picks are made one at a time, each against the others' DoPs of its
own run. Run as a schedule (every test run pinned to its pick, everything else as
``tangram`` schedules it) the picks delay each other (``oracle_as_schedule``: that run).

This script searches for a real schedule instead. Each test run is labelled with the
``--window`` (seconds) in which it was submitted in the ``tangram`` run, a label only
hindsight has. A *choice* per window fixes the DoP of every test run labelled with it:

- ``p:λ``, each at the amount on the core-seconds frontier at price ``λ``: the allowed ``k``
  that minimises ``(k + λ) · t(k)`` (``elastic_frontier.py``); test runs with a large
  parallel part get more units than the others at the same price;
- ``k:K``, each at the largest allowed amount ``<= K`` (a fixed DoP for that window).

Each vector of choices is simulated on the trace with the test runs pinned to those amounts
(tool calls, API and GPU calls, node placement and queue order are ``tangram``'s). The goal
pair is the issue's: the all-actions avg and p99 ≤ those of the fixed DoP with the least avg
(``best_all``; fig9's verdict), and the test runs' avg ≤ that of the fixed DoP best for them
(``best_test``). The search minimises the test runs' avg ACT over vectors that keep the
all-actions goal (a vector that breaks it ranks below every one that keeps it, by how far
it breaks it): first every uniform vector (one choice for all windows), then from two of
those, the best and the one with the fastest test runs, ``--sweeps`` rounds of coordinate
descent each: every choice in each window, in time order, kept when it lowers the
objective; a round that changes nothing ends that descent. The better end is the result.

``hindsight`` is the best vector found and its run. ``reached``: it keeps the all-actions
goal and meets the test runs' goal, so a DoP rule that knew the future could meet both.
If not, the search found no such choice, even in hindsight: the test-run goal needs what
the DoP did not give (the test runs waiting less while the tool calls wait no more). A
local search, not a proof: it tries these families, windows and the scheduler's queue order;
``gap_to_goal`` is how far its best is above the goal, ``rules`` how far each policy's test
runs are above it (and whether that policy keeps the all-actions goal).

Prints a markdown summary (``--json``: one object); ``--save`` stores the object in
``bench/paper/out/hindsight.json`` (``{"rows": [...]}``), replacing the row of the same
workload, batch and seed. Deterministic: the same arguments give the same numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
from common import action_kind, is_test
from elastic_frontier import WORKLOADS, cluster_of, goal, run_policy, save

from tangram.model import Choices, Range
from tangram.sim import generate
from tangram.sim.cluster import ClusterSpec
from tangram.sim.metrics import ActionRecord
from tangram.sim.trace import TraceAction, Trajectory

SAVED = common.OUT / "hindsight.json"
POLICIES = ("tangram", "fixed-dop:4", "fixed-dop:8", "fixed-dop:16")
Choice = tuple[str, float]  # ("p", λ) or ("k", K)
Vector = tuple[Choice, ...]  # one choice per window
# what each run reports (``elastic_frontier.decompose``'s names)
KEYS = ("avg_act_s", "p99_act_s", "test_avg_act_s", "test_run_s", "test_wait_s", "test_units",
        "tool_avg_act_s", "tool_wait_s")  # fmt: skip


def amount(a: TraceAction, choice: Choice) -> int:
    """The amount ``choice`` gives test run ``a`` (module doc)."""
    ks = a.template.allowed_units()
    what, v = choice
    if what == "p":
        return min(ks, key=lambda k: ((k + v) * a.true_duration(k), k))
    fit = [k for k in ks if k <= v]
    return fit[-1] if fit else ks[0]


def pinned(trace: Sequence[Trajectory], dop: dict[str, int]) -> list[Trajectory]:
    """The trace with every test run named in ``dop`` (``"<trajectory>#<step>"``, the
    simulator's action id) allowed exactly that amount."""
    out = []
    for t in trace:
        steps = list(t.steps)
        for i, a in enumerate(steps):
            k = dop.get(f"{t.id}#{i}")
            if k is not None and isinstance(a, TraceAction):
                tpl = a.template
                amounts = Range(k, k) if tpl.key == "cpu" else Choices((k,))
                steps[i] = replace(
                    a, template=replace(tpl, demand={**tpl.demand, tpl.key: amounts})
                )
        out.append(replace(t, steps=tuple(steps)))
    return out


def measure_run(
    cluster: ClusterSpec, trace: Sequence[Trajectory], policy: str
) -> tuple[dict[str, Any], list[ActionRecord]]:
    """``elastic_frontier.run_policy``, its p99 to 4 decimals (as the goals compare it)."""
    row, records = run_policy(cluster, trace, policy)
    row["p99_act_s"] = round(row["p99_act_s"], 4)
    return row, records


def baseline(
    workload: str, batch: int, seed: int, window_s: float
) -> tuple[dict[str, dict[str, Any]], dict[str, int], list[int], dict[str, tuple[float, int]]]:
    """The policies' runs (``POLICIES``); each test run's window (numbered over the windows
    that have test runs, in time order) and those windows' numbers in the ``tangram`` run;
    and per test run the least ACT over the runs with the DoP it had there."""
    cluster = cluster_of(workload)
    trace = generate(workload, cluster, batch, seed=seed)
    if not any(is_test(a) for t in trace for a in t.steps):
        raise ValueError(f"workload {workload!r} has no test runs (elastic exec, tag reward)")
    rows: dict[str, dict[str, Any]] = {}
    labels: dict[str, int] = {}
    picks: dict[str, tuple[float, int]] = {}
    for p in POLICIES:
        rows[p], records = measure_run(cluster, trace, p)
        for r in records:
            if action_kind(r) != "test" or r.failed:
                continue
            if p == "tangram":  # hindsight's labels: the window each test run was submitted in
                labels[r.action_id] = int((r.start_s - r.queue_s) // window_s)
            if r.action_id not in picks or r.act_s < picks[r.action_id][0]:
                picks[r.action_id] = (r.act_s, r.units)
    used = sorted(set(labels.values()))
    index = {w: i for i, w in enumerate(used)}
    return rows, {aid: index[w] for aid, w in labels.items()}, used, picks


# one worker's trace, test runs and their windows (set by _init: the trace is regenerated
# in each worker process rather than pickled to it)
_W: dict[str, Any] = {}


def _init(workload: str, batch: int, seed: int, labels: dict[str, int]) -> None:
    cluster = cluster_of(workload)
    trace = generate(workload, cluster, batch, seed=seed)
    tests = {f"{t.id}#{i}": a for t in trace for i, a in enumerate(t.steps) if is_test(a)}
    _W.update(cluster=cluster, trace=trace, tests=tests, labels=labels)


def evaluate(vector: Vector | dict[str, int]) -> dict[str, Any]:
    """One vector's run, or one with the given amount per test run (in a worker set up by
    ``_init``)."""
    tests: dict[str, TraceAction] = _W["tests"]
    labels: dict[str, int] = _W["labels"]
    if isinstance(vector, dict):
        dop = vector
    else:
        dop = {aid: amount(a, vector[labels[aid]]) for aid, a in tests.items() if aid in labels}
    row, records = measure_run(_W["cluster"], pinned(_W["trace"], dop), "tangram")
    done = sum(1 for r in records if action_kind(r) == "test" and not r.failed)
    return {k: row[k] for k in KEYS} | {"test_runs": done}


class _Inline:
    """``--workers 1``: the runs in this process, one after another."""

    def __init__(self, initargs: tuple[Any, ...]) -> None:
        _init(*initargs)

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        _W.clear()

    def map(self, fn: Any, items: Sequence[Any]) -> Iterator[Any]:
        return map(fn, items)

    def submit(self, fn: Any, arg: Any) -> Future[Any]:
        done: Future[Any] = Future()
        done.set_result(fn(arg))
        return done


def _pool(workers: int, initargs: tuple[Any, ...]) -> Any:
    if workers == 1:
        return _Inline(initargs)
    return ProcessPoolExecutor(max_workers=workers, initializer=_init, initargs=initargs)


def name(c: Choice) -> str:
    return f"{c[0]}:{c[1]:g}"


def search(
    workload: str,
    batch: int,
    seed: int,
    window_s: float,
    choices: Sequence[Choice],
    sweeps: int,
    workers: int,
    progress: bool = True,
) -> dict[str, Any]:
    """The policies' runs, then the search (module doc); one JSON-ready row."""
    rows, labels, used, picks = baseline(workload, batch, seed, window_s)
    g = goal(rows, [p for p in POLICIES if p.startswith("fixed-dop:")], ())
    a_goal, t_goal = g["all_avg_goal_s"], g["test_avg_goal_s"]
    p_goal = rows[g["best_all"]]["p99_act_s"]
    n = len(used)

    def keeps(r: dict[str, Any]) -> bool:
        return r["avg_act_s"] <= a_goal and r["p99_act_s"] <= p_goal

    def score(r: dict[str, Any]) -> float:
        if keeps(r):
            return float(r["test_avg_act_s"])
        over = max(0.0, r["avg_act_s"] / a_goal - 1.0) + max(0.0, r["p99_act_s"] / p_goal - 1.0)
        return 1e6 * (1.0 + over)

    seen: dict[Vector, dict[str, Any]] = {}
    with _pool(workers, (workload, batch, seed, labels)) as pool:

        def run_all(vectors: list[Vector]) -> None:
            todo = [v for v in dict.fromkeys(vectors) if v not in seen]
            for v, r in zip(todo, pool.map(evaluate, todo), strict=True):
                seen[v] = r
            if progress and len(seen) // 50 > (len(seen) - len(todo)) // 50:
                print(f"  [{workload} b={batch} s={seed}: {len(seen)} runs]", file=sys.stderr)

        oracle = pool.submit(evaluate, {aid: k for aid, (_, k) in picks.items()})
        uniform = [tuple([c] * n) for c in choices]
        run_all(uniform)
        # two starts: the best uniform vector, and the uniform one with the fastest test runs
        # (which may break the all-actions goal: the descent then first mends that)
        starts = [
            min(uniform, key=lambda v: score(seen[v])),
            min(uniform, key=lambda v: seen[v]["test_avg_act_s"]),
        ]
        ends: list[tuple[Vector, int]] = []
        for best in dict.fromkeys(starts):
            rounds = 0
            for _ in range(sweeps):
                rounds += 1
                changed = False
                for w in range(n):
                    trial = [(*best[:w], c, *best[w + 1 :]) for c in choices]
                    run_all(trial)
                    top = min(trial, key=lambda v: score(seen[v]))
                    if score(seen[top]) < score(seen[best]):
                        best, changed = top, True
                if not changed:
                    break
            ends.append((best, rounds))
        best, rounds = min(ends, key=lambda e: score(seen[e[0]]))
        as_schedule = oracle.result()
    h = seen[best]
    reached = keeps(h) and h["test_avg_act_s"] <= t_goal
    return {
        "workload": workload,
        "batch": batch,
        "seed": seed,
        "window_s": window_s,
        "windows": [
            {"start_s": w * window_s, "test_runs": sum(1 for x in labels.values() if x == i)}
            for i, w in enumerate(used)
        ],
        "goal": {
            "best_all": g["best_all"],
            "all_avg_goal_s": a_goal,
            "all_p99_goal_s": p_goal,
            "best_test": g["best_test"],
            "test_avg_goal_s": t_goal,
        },
        "policies": {p: {k: r[k] for k in KEYS} for p, r in rows.items()},
        "oracle_as_schedule": {
            "oracle_test_avg_act_s": round(sum(a for a, _ in picks.values()) / len(picks), 4),
            **as_schedule,
            "keeps_all_goal": keeps(as_schedule),
        },
        "uniform": [
            {"choice": name(v[0]), **seen[v], "keeps_all_goal": keeps(seen[v])} for v in uniform
        ],
        "hindsight": {
            "choices": [name(c) for c in best],
            **h,
            "keeps_all_goal": keeps(h),
            "runs": len(seen),
            "rounds": rounds,
        },
        "reached": reached,
        "gap_to_goal": round(h["test_avg_act_s"] / t_goal - 1.0, 4),
        "rules": {
            p: {
                "test_over_hindsight": round(r["test_avg_act_s"] / h["test_avg_act_s"] - 1.0, 4),
                "keeps_all_goal": keeps(r),
            }
            for p, r in rows.items()
        },
    }


def parse_list(ap: argparse.ArgumentParser, flag: str, text: str, lo: float) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ap.error(f"{flag}: expected comma-separated numbers, got {text!r}")
    if any(not math.isfinite(v) or v < lo for v in vals):
        ap.error(f"{flag}: every value must be a finite number >= {lo:g}, got {text!r}")
    return vals


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="ai-coding", choices=WORKLOADS)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--window", type=float, default=60.0, help="seconds per window (60)")
    ap.add_argument("--prices", default="4,8,12,16,24,32", help="λ choices (p:λ)")
    ap.add_argument("--amounts", default="8,12,16", help="fixed DoP choices (k:K)")
    ap.add_argument("--sweeps", type=int, default=4, help="coordinate-descent rounds at most (4)")
    ap.add_argument("--workers", type=int, default=2, help="simulations run at once (2)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save", action="store_true", help=f"store the result in {SAVED.name}")
    args = ap.parse_args(argv)
    if args.batch <= 0:
        ap.error(f"--batch: expected a positive integer, got {args.batch}")
    if not (math.isfinite(args.window) and args.window > 0):
        ap.error(f"--window: expected a positive number of seconds, got {args.window}")
    if args.sweeps < 0:
        ap.error(f"--sweeps: expected an integer >= 0, got {args.sweeps}")
    if args.workers < 1:
        ap.error(f"--workers: expected an integer >= 1, got {args.workers}")
    choices: list[Choice] = [("p", v) for v in parse_list(ap, "--prices", args.prices, 0.0)]
    choices += [("k", v) for v in parse_list(ap, "--amounts", args.amounts, 1.0)]
    if not choices:
        ap.error("--prices and --amounts: give at least one choice")
    t0 = time.perf_counter()
    out = search(
        args.workload, args.batch, args.seed, args.window, choices, args.sweeps, args.workers
    )
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    if args.save:
        save(out, SAVED)
    if args.json:
        print(json.dumps(out))
        return 0
    g, h = out["goal"], out["hindsight"]
    print(
        f"{args.workload}, batch {args.batch}, seed {args.seed}: goals all-actions avg <= "
        f"{g['all_avg_goal_s']} and p99 <= {g['all_p99_goal_s']} ({g['best_all']}), test runs "
        f"<= {g['test_avg_goal_s']} ({g['best_test']})"
    )
    print("\n| run | avg | p99 | test ACT (run + wait) | tool ACT (wait) | keeps all-actions |")
    print("|---|---|---|---|---|---|")
    rows = [(p, r, out["rules"][p]["keeps_all_goal"]) for p, r in out["policies"].items()]
    o = out["oracle_as_schedule"]
    rows.append(
        (f"fig9 oracle's picks ({o['oracle_test_avg_act_s']} as picked)", o, o["keeps_all_goal"])
    )
    rows += [(f"uniform {u['choice']}", u, u["keeps_all_goal"]) for u in out["uniform"]]
    rows.append((f"hindsight {' '.join(h['choices'])}", h, h["keeps_all_goal"]))
    for label, r, keep in rows:
        print(
            f"| {label} | {r['avg_act_s']} | {r['p99_act_s']} | {r['test_avg_act_s']} "
            f"({r['test_run_s']} + {r['test_wait_s']}) | {r['tool_avg_act_s']} "
            f"({r['tool_wait_s']}) | {'yes' if keep else 'no'} |"
        )
    print(
        f"\nhindsight ({h['runs']} runs, {h['rounds']} rounds): test runs {h['test_avg_act_s']} s, "
        f"{out['gap_to_goal']:+.1%} against the goal; reached: {out['reached']}"
    )
    for p, r in out["rules"].items():
        print(f"  {p}: test runs {r['test_over_hindsight']:+.1%} over hindsight")
    print(f"wall {out['wall_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
