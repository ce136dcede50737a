"""Fig. 9: the elastic scheduler vs every fixed DoP over batch sizes (AI coding), two seeds.

Usage: python bench/paper/fig9.py [--batches 256,1024,1280,2048] [--seeds 0,1]
                                  [--mixed 64,128] [--fixed 1,2,4,8,16] [--rules] [--jobs 2]
       python bench/paper/fig9.py --tally fig9-seeds,fig9-fresh [--json]

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

from common import IMG, OUT, ROOT, load_cluster, paper_cluster, ratio, run, save

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
    res = run(cluster, workload, batch, policies, seed=seed)
    return (workload, batch, seed), {p: r.summary for p, r in res.items()}


def best_fixed(res: dict[str, Any], among: Sequence[str] | None = None) -> str:
    """The fixed DoP with the lowest avg ACT among ``among`` (default: the ones run)."""
    return min(FIXED if among is None else among, key=lambda p: res[p]["avg_act_s"])


def verdict(res: dict[str, Any], k8s: bool) -> str:
    t, b = res["tangram"], res[best_fixed(res)]
    ok = t["avg_act_s"] <= b["avg_act_s"] and t["p99_act_s"] <= b["p99_act_s"]
    out = "yes" if ok else "**no**"
    if k8s:
        out += f", {ratio(res['k8s']['avg_act_s'], t['avg_act_s'])} vs k8s"
    return out


def per_policy(rows: list[Any], columns: Sequence[str], field: str, fmt: str, title: str) -> None:
    """One markdown table: a row per (workload, batch, seed), a column per policy."""
    print(f"\n{title}:\n")
    print("| workload | batch | seed | " + " | ".join(columns) + " |")
    print("|---|---|---|" + "---|" * len(columns))
    for (wl, b, seed), res in rows:
        cells = " | ".join(fmt.format(res[p][field]) for p in columns)
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


def _cell(res: dict[str, Any], p: str) -> str:
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
    ap.add_argument("--out", default="fig9", help="output name under bench/paper/out (doc)")
    ap.add_argument("--tally", default="", help="count wins in these output files, run nothing")
    ap.add_argument("--json", action="store_true", help="with --tally: one JSON list")
    args = ap.parse_args()
    if args.tally:
        _print_tally(args.tally.split(","), args.json)
        return
    global FIXED
    FIXED = tuple(f"fixed-dop:{k}" for k in args.fixed.split(","))
    started = time.perf_counter()
    policies = (*MAIN, *(RULES if args.rules else ()), *FIXED, "k8s")
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
    key = lambda k: (k[0] != "ai-coding", k[0], k[2], k[1])  # noqa: E731
    rows = sorted(done.items(), key=lambda kv: key(kv[0]))
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
    if args.out == "fig9" and coding:
        _plot([r for r in coding if r[0][2] == seeds[0]], policies)
    # --only: the rows not run keep their numbers in the output file
    doc = {k: v for k, v in previous.items() if k != "wall_s"}
    doc.update({f"{wl}/{b}/seed{seed}": res for (wl, b, seed), res in rows})
    save(args.out, doc, started)


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
