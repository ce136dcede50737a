"""Fig. 9: the elastic scheduler vs every fixed DoP over batch sizes (AI coding), two seeds.

Usage: python bench/paper/fig9.py [--batches 256,1024,1280,2048] [--seeds 0,1]
                                  [--mixed 64,128] [--fixed 1,2,4,8,16] [--rules] [--jobs 2]
                                  [--no-eft] [--json]
       python bench/paper/fig9.py --tally fig9-seeds,fig9-fresh [--json]
       python bench/paper/fig9.py --show fig9-kinds [--json]

``tangram`` is the default ``priced`` rule, ``tangram-eft`` the previous default
(``wait-eft``); ``--rules`` also runs ``tangram-wait`` and ``tangram-paper``. fixed-dop:K runs
every elastic action on exactly K units, K in {1, 2, 4, 8, 16}; "best fixed" is the K with the
lowest avg ACT on that very trace, picked in hindsight. ``--mixed`` adds the mixed workloads
(``coding+search``, ``mixed``) on ``config/cluster-mixed.toml`` (4 × 64 cores) at those
batch sizes. ``--only P,Q`` runs just those policies and takes every other one's numbers
from the previous output file (``bench/paper/out/fig9.json``, or ``NAME.json`` with ``--out``;
same workload, batch and seed; the traces are deterministic), e.g. ``--only tangram`` after a
change to the priced rule alone; the rows run are merged into that file (rows not run keep
their numbers). ``--batches ''`` runs no AI-coding row (e.g. only the mixed workloads, over
more seeds); ``--out NAME`` writes just the rows run to ``bench/paper/out/NAME.json``
instead of ``fig9.json`` (and skips the plot). Paper: tangram is 3.0× faster than DoP=16 at
batch 1280 (avg ACT).

Every run also reports each action kind apart (``common.KINDS``: 1-core tool calls, test runs,
API calls, GPU calls): tangram against the fixed DoP best *for those actions*, and for the
test runs an oracle (``oracle()``: each test run at the DoP, of those seen in the row's runs,
under which it finished soonest) and a floor (each alone at its fastest amount, no queue: a
true lower bound); ``--json`` prints those per-kind rows as one JSON document, ``--show A,B``
prints them from stored output files without running anything. ``--no-eft`` skips
``tangram-eft`` and ``k8s`` (the slow ones; the per-kind comparison does not need them).

``--tally A,B`` runs nothing: it reads ``bench/paper/out/A.json`` (and B...) and counts, per
workload and batch, the rows where ``tangram`` ≤ the best fixed DoP on avg, on p99 and on
both, with the geometric mean of the ratios and a one-sided sign test of the p99 wins (so a
loss on a few traces can be told from a systematic one).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import common
from common import (
    IMG,
    KINDS,
    OUT,
    ROOT,
    generate,
    is_test,
    load_cluster,
    paper_cluster,
    ratio,
    run,
    save,
)

from tangram.sim.trace import Trajectory

FIXED = tuple(f"fixed-dop:{k}" for k in (1, 2, 4, 8, 16))  # narrowed by --fixed
MAIN = ("tangram", "tangram-eft")
RULES = ("tangram-wait", "tangram-paper")


def _one(args: tuple[str, str, int, int, tuple[str, ...]]) -> tuple[tuple[str, int, int], dict]:
    cluster_name, workload, batch, seed, policies = args
    cluster = (
        paper_cluster()
        if cluster_name == "paper"
        else load_cluster(ROOT / "config" / f"cluster-{cluster_name}.toml")
    )
    common.KEEP_TEST_ACTS = True
    common.TEST_ACTS.clear()
    res = run(cluster, workload, batch, policies, seed=seed)
    out: dict[str, Any] = {p: r.summary for p, r in res.items()}
    seen = [p for p in policies if p.startswith("fixed-dop:") or p == "tangram"]
    if all(p in policies for p in (*FIXED, "tangram")):  # (--only: kept from before)
        trace = generate(workload, cluster, batch, seed=seed)
        out["oracle"] = oracle({p: common.TEST_ACTS[p] for p in seen}, trace)
    return (workload, batch, seed), out


def oracle(acts: dict[str, dict[str, float]], trace: Sequence[Trajectory]) -> dict[str, Any]:
    """The test runs' hindsight-optimal DoP per action, and their no-contention floor.

    ``test_avg_act_s``: each test run takes, of the runs in ``acts`` (every fixed DoP K and
    ``tangram``), the one in which it finished soonest: its DoP there, with the rest of the
    schedule as it was in that run; the mean over test runs. ``chosen`` counts the picks.
    It is an approximation of the per-action optimum, not a feasible schedule (the others'
    DoPs are not chosen together) and not a proven bound; it is what choosing each action's
    DoP in hindsight among those seen would give, the reference a rule is measured against.
    ``test_floor_s``: each test run alone at its fastest amount, no queue: a lower bound on
    the test runs' avg ACT under any schedule (every one waits >= 0 and runs >= that)."""
    ids = set.intersection(*(set(a) for a in acts.values())) if acts else set()
    chosen: dict[str, int] = {}
    total = 0.0
    for aid in ids:
        p = min(acts, key=lambda q: acts[q][aid])
        total += acts[p][aid]
        k = p.split(":")[1] if ":" in p else p
        chosen[k] = chosen.get(k, 0) + 1
    floors = [
        min(a.true_duration(k) for k in a.template.allowed_units())
        for t in trace
        for a in t.actions()
        if is_test(a)
    ]
    return {
        "test_runs": len(ids),
        "test_avg_act_s": round(total / len(ids), 6) if ids else 0.0,
        "test_floor_s": round(statistics.fmean(floors), 6) if floors else 0.0,
        "chosen": dict(sorted(chosen.items(), key=lambda kv: (not kv[0].isdigit(), kv[0]))),
    }


def best_fixed(res: dict[str, Any], among: Sequence[str] | None = None) -> str:
    """The fixed DoP with the lowest avg ACT among ``among`` (default: the ones run)."""
    return min(FIXED if among is None else among, key=lambda p: res[p]["avg_act_s"])


def verdict(res: dict[str, Any], k8s: bool) -> str:
    t, b = res["tangram"], res[best_fixed(res)]
    ok = t["avg_act_s"] <= b["avg_act_s"] and t["p99_act_s"] <= b["p99_act_s"]
    out = "yes" if ok else "**no**"
    if k8s and "k8s" in res:
        out += f", {ratio(res['k8s']['avg_act_s'], t['avg_act_s'])} vs k8s"
    return out


def per_policy(rows: list[Any], columns: Sequence[str], field: str, fmt: str, title: str) -> None:
    """One markdown table: a row per (workload, batch, seed), a column per policy."""
    print(f"\n{title}:\n")
    print("| workload | batch | seed | " + " | ".join(columns) + " |")
    print("|---|---|---|" + "---|" * len(columns))
    for (wl, b, seed), res in rows:
        cells = " | ".join(fmt.format(res[p][field]) if p in res else "" for p in columns)
        print(f"| {wl} | {b} | {seed} | {cells} |")


def table(rows: list[tuple[tuple[str, int, int], dict]], title: str) -> None:
    print(f"\n{title}\n")
    print(
        "| workload | batch | seed | tangram (priced) avg / p99 | tangram-eft (old default) "
        "avg / p99 | best fixed DoP (K) avg / p99 | k8s avg / p99 | priced ≤ best fixed "
        "(avg and p99) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (wl, b, seed), res in rows:
        k = best_fixed(res)
        print(
            f"| {wl} | {b} | {seed} | {_cell(res, 'tangram')} | {_cell(res, 'tangram-eft')} | "
            f"{_cell(res, k)} ({k.split(':')[1]}) | {_cell(res, 'k8s')} | {verdict(res, True)} |"
        )


def per_kind(rows: list[tuple[tuple[str, int, int], dict]]) -> list[dict[str, Any]]:
    """Per row and action kind (``common.KINDS``), plus ``all``: tangram's avg / p99 ACT, the
    fixed DoP best for those very actions (least avg, in hindsight), and for the test runs
    the oracle and the floor (``oracle``). ``ok``: tangram's avg ≤ that best fixed DoP's (for
    ``all``: avg and p99 ≤ the fixed DoP best over all actions, today's goal)."""
    out: list[dict[str, Any]] = []
    for (wl, b, seed), res in rows:
        fixed = [p for p in res if p.startswith("fixed-dop:")]
        if not fixed or not all("by_kind" in res.get(p, {}) for p in ("tangram", *fixed)):
            continue  # (a file written before by_kind)
        for kind in ("all", *KINDS):

            def of(p: str, kind: str = kind, res: dict = res) -> dict[str, Any] | None:
                return res[p] if kind == "all" else res[p]["by_kind"].get(kind)

            t = of("tangram")
            if t is None:
                continue
            k = min(fixed, key=lambda p: of(p)["avg_act_s"])  # type: ignore[index]
            bf = of(k)
            assert bf is not None
            ok = t["avg_act_s"] <= bf["avg_act_s"]
            if kind == "all":
                ok = ok and t["p99_act_s"] <= bf["p99_act_s"]
            row = {
                "workload": wl,
                "batch": b,
                "seed": seed,
                "kind": kind,
                "actions": t["actions"],
                "tangram": [t["avg_act_s"], t["p99_act_s"]],
                "best_fixed": int(k.split(":")[1]),
                "best_fixed_act": [bf["avg_act_s"], bf["p99_act_s"]],
                "fixed_avg": {p.split(":")[1]: of(p)["avg_act_s"] for p in fixed},  # type: ignore[index]
                "ok": ok,
            }
            if kind == "test" and "oracle" in res:
                o = res["oracle"]
                row["oracle"] = o["test_avg_act_s"]
                row["floor"] = o["test_floor_s"]
            out.append(row)
    return out


def kinds_table(out: list[dict[str, Any]], title: str) -> None:
    """One line per trace: all actions, tool calls and test runs (the JSON has every kind)."""
    print(f"\n{title}\n")
    print(
        "| workload | batch | seed | all: tangram avg / p99 | all: best fixed (K) avg / p99 "
        "| tool: tangram / best fixed | test: tangram | test: best fixed (K) | test: oracle "
        "| test: floor | tangram / oracle | best fixed / oracle | goals: test, all |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows: dict[tuple[str, int, int], dict[str, dict[str, Any]]] = {}
    for r in out:
        rows.setdefault((r["workload"], r["batch"], r["seed"]), {})[r["kind"]] = r
    for (wl, b, seed), by in rows.items():
        a, tool, test = by["all"], by.get("tool"), by.get("test")
        cells = [
            f"{a['tangram'][0]:.3f} / {a['tangram'][1]:.1f}",
            f"{a['best_fixed_act'][0]:.3f} / {a['best_fixed_act'][1]:.1f} ({a['best_fixed']})",
            f"{tool['tangram'][0]:.2f} / {tool['best_fixed_act'][0]:.2f}" if tool else "",
        ]
        if test:
            o = test.get("oracle", 0.0)
            cells += [
                f"{test['tangram'][0]:.2f}",
                f"{test['best_fixed_act'][0]:.2f} ({test['best_fixed']})",
                f"{o:.2f}" if o else "",
                f"{test['floor']:.2f}" if "floor" in test else "",
                f"{test['tangram'][0] / o:.2f}×" if o else "",
                f"{test['best_fixed_act'][0] / o:.2f}×" if o else "",
            ]
        else:
            cells += [""] * 6
        goals = f"{_yes(test['ok']) if test else '-'}, {_yes(a['ok'])}"
        print(f"| {wl} | {b} | {seed} | " + " | ".join(cells) + f" | {goals} |")


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def _cell(res: dict[str, Any], p: str) -> str:
    if p not in res:
        return "not run"
    return f"{res[p]['avg_act_s']:.3f} / {res[p]['p99_act_s']:.1f}"


def tally(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (workload, batch): how often ``tangram`` ≤ the best fixed DoP (module doc)."""
    groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for key, res in rows.items():
        parts = key.split("/")
        if len(parts) != 3 or "tangram" not in res:
            continue  # not a row (e.g. the file's wall_s)
        wl, batch = parts[0], int(parts[1])
        fixed = [p for p in res if p.startswith("fixed-dop:")]  # whatever that file ran
        if not fixed:
            continue
        t, b = res["tangram"], res[best_fixed(res, fixed)]
        ratios = (t["avg_act_s"] / b["avg_act_s"], t["p99_act_s"] / b["p99_act_s"])
        groups.setdefault((wl, batch), []).append(ratios)
    out = []
    for (workload, batch), rs in sorted(groups.items()):
        n = len(rs)
        p99_wins = sum(p <= 1 for _, p in rs)
        out.append(
            {
                "workload": workload,
                "batch": batch,
                "rows": n,
                "avg_le": sum(a <= 1 for a, _ in rs),
                "p99_le": p99_wins,
                "both": sum(a <= 1 and p <= 1 for a, p in rs),
                "geo_avg": round(math.exp(statistics.fmean(math.log(a) for a, _ in rs)), 3),
                "geo_p99": round(math.exp(statistics.fmean(math.log(p) for _, p in rs)), 3),
                "worst_p99": round(max(p for _, p in rs), 3),
                # P(at least this many p99 wins) if each row were a fair coin
                "sign_p": round(sum(math.comb(n, k) for k in range(p99_wins, n + 1)) / 2**n, 4),
            }
        )
    return out


def _print_tally(names: Sequence[str], as_json: bool) -> None:
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        rows.update(json.loads((OUT / f"{name}.json").read_text()))
    out = tally(rows)
    if as_json:
        print(json.dumps(out))
        return
    print(f"\n`tangram` against the best fixed DoP per row ({', '.join(names)})\n")
    print(
        "| workload | batch | rows | avg ≤ | p99 ≤ | both | geo avg / p99 | worst p99 "
        "| sign test p (p99) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in out:
        print(
            f"| {r['workload']} | {r['batch']} | {r['rows']} | {r['avg_le']} | {r['p99_le']} "
            f"| {r['both']} | {r['geo_avg']:.3f} / {r['geo_p99']:.3f} | {r['worst_p99']:.3f} "
            f"| {r['sign_p']} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="256,1024,1280,2048")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--mixed", default="", help="batch sizes of the mixed workloads")
    ap.add_argument("--rules", action="store_true", help="also tangram-wait and tangram-paper")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--fixed", default="1,2,4,8,16", help="the fixed DoPs K to run")
    ap.add_argument("--only", default="", help="run these policies, reuse the rest (doc)")
    ap.add_argument("--no-eft", action="store_true", help="skip tangram-eft and k8s (slow)")
    ap.add_argument("--out", default="fig9", help="output name under bench/paper/out (doc)")
    ap.add_argument("--tally", default="", help="count wins in these output files, run nothing")
    ap.add_argument("--json", action="store_true", help="with --tally: one JSON list")
    ap.add_argument("--show", default="", help="print the per-kind table of these files")
    args = ap.parse_args()
    if args.tally:
        _print_tally(args.tally.split(","), args.json)
        return
    if args.show:
        stored: dict[str, Any] = {}
        for name in args.show.split(","):
            stored.update(json.loads((OUT / f"{name}.json").read_text()))
        _print_kinds(_rows_of(stored), args.json)
        return
    global FIXED
    FIXED = tuple(f"fixed-dop:{k}" for k in args.fixed.split(","))
    started = time.perf_counter()
    policies = (*MAIN, *(RULES if args.rules else ()), *FIXED, "k8s")
    if args.no_eft:
        policies = tuple(p for p in policies if p not in ("tangram-eft", "k8s"))
    previous: dict[str, Any] = {}
    to_run = policies
    if args.only:
        to_run = tuple(args.only.split(","))
        previous = json.loads((OUT / f"{args.out}.json").read_text())
    seeds = [int(s) for s in args.seeds.split(",")]
    work = [
        ("paper", "ai-coding", int(b), seed, to_run)
        for seed in seeds
        for b in args.batches.split(",")
        if b
    ]
    if args.mixed:
        work += [
            ("mixed", wl, int(b), seed, to_run)
            for wl in ("coding+search", "mixed")
            for seed in seeds
            for b in args.mixed.split(",")
        ]
    # longest first, so that the workers finish together
    work.sort(key=lambda w: -w[2] * (2 if w[1] == "ai-coding" else 1))
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        done = dict(pool.map(_one, work))
    for (wl, b, seed), res in done.items():  # --only: the other policies' previous numbers
        old = previous.get(f"{wl}/{b}/seed{seed}", {})
        for p in policies:
            if p not in res:
                res[p] = {**old[p], "reused": True}
        if "oracle" not in res and "oracle" in old:  # (from the runs of the previous file)
            res["oracle"] = {**old["oracle"], "reused": True}
    key = lambda k: (k[0] != "ai-coding", k[0], k[2], k[1])  # noqa: E731
    rows = sorted(done.items(), key=lambda kv: key(kv[0]))
    if args.json:  # the per-kind rows alone (the markdown tables are the default output)
        doc = {k: v for k, v in previous.items() if k != "wall_s"}
        doc.update({f"{wl}/{b}/seed{seed}": res for (wl, b, seed), res in rows})
        save(args.out, doc, started, quiet=True)
        _print_kinds(rows, True)
        return
    coding = [r for r in rows if r[0][0] == "ai-coding"]
    if coding:
        table(coding, "AI coding, config/cluster-paper.toml (15 × 256 cores); avg / p99 ACT (s)")
    mixed = [r for r in rows if r[0][0] != "ai-coding"]
    if mixed:
        table(mixed, "Mixed workloads, config/cluster-mixed.toml (4 × 64 cores); avg / p99 ACT (s)")
    per_policy(rows, FIXED, "avg_act_s", "{:.3f}", "All fixed DoPs, avg ACT (s)")
    per_policy(
        rows,
        policies,
        "wall_s_not_deterministic",
        "{:.1f}",
        "Wall time per simulated run (s, noisy: shared machine)",
    )
    _print_kinds(rows, False)
    if args.out == "fig9" and coding:
        _plot([r for r in coding if r[0][2] == seeds[0]], policies)
    # --only: the rows not run keep their numbers in the output file
    doc = {k: v for k, v in previous.items() if k != "wall_s"}
    doc.update({f"{wl}/{b}/seed{seed}": res for (wl, b, seed), res in rows})
    save(args.out, doc, started)


def _rows_of(stored: dict[str, Any]) -> list[tuple[tuple[str, int, int], dict]]:
    rows = []
    for key, res in stored.items():
        parts = key.split("/")
        if len(parts) == 3:
            rows.append(((parts[0], int(parts[1]), int(parts[2].removeprefix("seed"))), res))
    rows.sort(key=lambda kv: (kv[0][0] != "ai-coding", kv[0][0], kv[0][2], kv[0][1]))
    return rows


def _print_kinds(rows: list[tuple[tuple[str, int, int], dict]], as_json: bool) -> None:
    out = per_kind(rows)
    if as_json:
        print(json.dumps({"rows": out}))
        return
    kinds_table(out, "Per action kind: ACT (s), avg unless p99 is named; oracle, floor (doc)")


def _plot(rows: list[tuple[tuple[str, int, int], dict]], policies: tuple[str, ...]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    xs = [b for (_, b, _), _ in rows]
    for p in policies:
        style = "-" if p.startswith("tangram") else "--"
        ax.plot(xs, [r[p]["avg_act_s"] for _, r in rows], marker="o", ls=style, label=p)
    ax.set_xlabel("RL batch size")
    ax.set_ylabel("avg ACT (s)")
    ax.set_yscale("log")
    ax.set_title("AI coding: priced elastic DoP vs fixed DoP (seed 0)")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(IMG / "fig9.png", dpi=110)


if __name__ == "__main__":
    main()
