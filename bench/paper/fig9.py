"""Fig. 9: the elastic scheduler vs fixed DoP 4/8/16 over batch sizes (AI coding).

Usage: python bench/paper/fig9.py [--batches 256,512,1024,1280,2048]
``tangram`` is our "wait" replay rule, ``tangram-paper`` the paper's, ``tangram-backfill`` the
wait rule with our backfill order; fixed-dop:K runs every elastic action on exactly K units.
Paper: tangram is 3.0× faster than DoP=16 at batch 1280 (avg ACT).
"""

from __future__ import annotations

import argparse
import time

from common import IMG, paper_cluster, ratio, run, save, summaries

POLICIES = (
    "tangram",
    "tangram-paper",
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
        + " | DoP16 / tangram ACT, step | DoP16 / tangram-paper ACT, step "
        "(paper at 1280: 3.0× ACT) |"
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
            for p in ("tangram", "tangram-paper")
        ]
        print(f"| {b} | " + " | ".join(cells) + " | " + " | ".join(gains) + " |")
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
