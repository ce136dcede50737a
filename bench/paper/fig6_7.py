"""Fig. 6/7: ACT and RL step time per workload, tangram vs the paper's baselines.

Usage: python bench/paper/fig6_7.py [--batch N]
Runs ai-coding, deepsearch, mopd and mopd+search at batch N (default 1024) on the paper
testbed under ``tangram`` (the default rule: "wait-eft" when the tables in docs/results.md
were made, "priced" now, see fig9.py), ``tangram-wait`` (the
"wait" rule, FCFS), ``tangram-paper`` (the paper's replay rule, FCFS), ``tangram-backfill``
(wait-eft rule, our backfill order) and ``baseline`` (k8s + static-services + api-retry), with
the ACT breakdown into queueing, restore and execution per action tag.
"""

from __future__ import annotations

import argparse
import time

from common import IMG, low_units, paper_cluster, ratio, run, save, summaries, tag_act

from tangram.sim.report import plot

PAPER = {  # paper §6 / docs/design.md §9
    "ai-coding": {"act": "4.3×", "step": "1.4×", "env": "9.0×", "reward": "2.8×"},
    "deepsearch": {"act": "lower (Fig. 6)", "step": "1.5×"},
    "mopd": {"act": "lower (Fig. 6)", "step": "small (long tail)"},
    "mopd+search": {"act": "lower (Fig. 6)", "step": "n/a"},
}
TANGRAMS = ("tangram", "tangram-wait", "tangram-paper", "tangram-backfill")
POLICIES = (*TANGRAMS, "baseline")
TAGS = {
    "ai-coding": ("tool", "reward"),
    "deepsearch": ("search", "reward"),
    "mopd": ("teacher",),
    "mopd+search": ("teacher", "search", "reward"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1024)
    args = ap.parse_args()
    started = time.perf_counter()
    doc: dict[str, object] = {"batch": args.batch}
    print(
        "| workload | metric | paper (tangram gain) | ours tangram | ours tangram-wait | "
        "ours tangram-paper | ours backfill | ours baseline | "
        "ours gain (tangram / wait / paper rule / backfill) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    low = []
    for wl in ("ai-coding", "deepsearch", "mopd", "mopd+search"):
        cluster = paper_cluster(judge_replicas=5 if wl == "deepsearch" else None)
        res = run(cluster, wl, args.batch, POLICIES)
        doc[wl] = summaries(res)
        plot(list(res.values()), str(IMG / f"fig6-{wl}.png"), title=f"{wl}, batch {args.batch}")
        b = res["baseline"].summary
        for label, key, paper in (
            ("avg ACT (s)", "avg_act_s", PAPER[wl]["act"]),
            ("step time (s)", "step_s", PAPER[wl]["step"]),
        ):
            cells = " | ".join(f"{res[p].summary[key]:.2f}" for p in POLICIES)
            gains = " / ".join(ratio(b[key], res[p].summary[key]) for p in TANGRAMS)
            print(f"| {wl} | {label} | {paper} | {cells} | {gains} |")
        for tag in TAGS[wl]:
            paper = PAPER[wl].get("env" if tag == "tool" else tag, "")
            parts = []
            for p in POLICIES:
                q, rs, e = (
                    tag_act(res[p], [tag], f)
                    for f in ("avg_queue_s", "avg_restore_s", "avg_exec_s")
                )
                parts.append(f"{q + rs + e:.2f} = {q:.2f}+{rs:.2f}+{e:.2f}")
            base = tag_act(res["baseline"], [tag])
            gains = " / ".join(ratio(base, tag_act(res[p], [tag])) for p in TANGRAMS)
            print(
                f"| {wl} | ACT `{tag}` (q+restore+exec) | {paper} | "
                + " | ".join(parts)
                + f" | {gains} |"
            )
        if wl == "ai-coding":
            low = [(p, low_units(res[p])) for p in TANGRAMS]
    print("\nai-coding test runs on < 4 cores (on 1): " + ", ".join(f"{p} {n}" for p, n in low))
    save("fig6_7", doc, started)


if __name__ == "__main__":
    main()
