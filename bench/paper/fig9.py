"""Fig. 9: the elastic scheduler vs fixed DoP 4/8/16 over batch sizes (AI coding).

Usage: python bench/paper/fig9.py [--batches 256,512,1024,1280,2048]
``tangram`` is our "wait-eft" replay rule, ``tangram-wait`` the "wait" rule, ``tangram-paper``
the paper's, ``tangram-backfill`` the wait-eft rule with our backfill order; fixed-dop:K runs
every elastic action on exactly K units. Paper: tangram is 3.0× faster than DoP=16 at batch
1280 (avg ACT). A second table lists, per rule, the test runs (``reward``) and tool calls.
"""

from __future__ import annotations

import argparse
import time

from common import IMG, low_units, paper_cluster, ratio, run, save, summaries, tag_act

TANGRAMS = ("tangram", "tangram-wait", "tangram-paper")
POLICIES = (
    *TANGRAMS,
    "tangram-backfill",
    "fixed-dop:4",
    "fixed-dop:8",
    "fixed-dop:16",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="256,512,1024,1280,2048")
    args = ap.parse_args()
    started = time.perf_counter()
    cluster = paper_cluster()
    doc: dict[str, object] = {}
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        res = run(cluster, "ai-coding", b, POLICIES)
        doc[str(b)] = summaries(res)
        rows.append((b, res))
    print(
        "| batch | "
        + " | ".join(f"{p} ACT / step (s)" for p in POLICIES)
        + " | DoP16 / (tangram, wait, paper rule): ACT, step | paper |"
    )
    print("|---" * (len(POLICIES) + 3) + "|")
    for b, res in rows:
        cells = [
            f"{res[p].summary['avg_act_s']:.2f} / {res[p].summary['step_s']:.0f}" for p in POLICIES
        ]
        d16 = res["fixed-dop:16"].summary
        gains = [
            f"{ratio(d16['avg_act_s'], res[p].summary['avg_act_s'])}, "
            f"{ratio(d16['step_s'], res[p].summary['step_s'])}"
            for p in TANGRAMS
        ]
        paper = "3.0× ACT" if b == 1280 else ""
        print(f"| {b} | " + " | ".join(cells) + " | " + " / ".join(gains) + f" | {paper} |")
    print(
        "\n| batch | rule | step (s) | avg ACT (s) | tool ACT (s) | test-run avg ACT (s) | "
        "test-run p99 ACT (s) | test-run avg cores | test runs < 4 cores (on 1) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for b, res in rows:
        for p in TANGRAMS:
            s, rw = res[p].summary, res[p].summary["by_tag"]["reward"]
            print(
                f"| {b} | {p} | {s['step_s']:.0f} | {s['avg_act_s']:.3f} | "
                f"{tag_act(res[p], ['tool']):.3f} | {rw['avg_act_s']:.1f} | "
                f"{rw['p99_act_s']:.0f} | {rw['avg_units']:.1f} | {low_units(res[p])} |"
            )
    _plot(rows)
    save("fig9", doc, started)


def _plot(rows: list) -> None:  # type: ignore[type-arg]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    xs = [b for b, _ in rows]
    for p in POLICIES:
        style = "--" if p == "tangram-backfill" else "-"  # equal to tangram so far: dashed
        ax.plot(xs, [r[p].summary["avg_act_s"] for _, r in rows], marker="o", ls=style, label=p)
    ax.set_xlabel("RL batch size")
    ax.set_ylabel("avg ACT (s)")
    ax.set_title("AI coding: elastic vs fixed DoP")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(IMG / "fig9.png", dpi=110)


if __name__ == "__main__":
    main()
