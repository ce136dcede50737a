"""Fig. 8 (CPU): average ACT of AI coding as the RL batch grows, tangram vs Kubernetes pods.

Usage: python bench/paper/fig8_cpu.py [--batches 256,512,1024,2048]
Policies ``tangram`` (the default rule: "wait-eft" when the tables in docs/results.md were
made, "priced" now, see fig9.py), ``tangram-wait`` (the "wait" rule),
``tangram-paper`` (the paper's rule) and ``k8s`` (the GPU/API parts are tangram in all; AI
coding uses only CPUs). Paper: tangram's avg ACT is 3.1× to 27.7× lower.
"""

from __future__ import annotations

import argparse
import time

from common import IMG, low_units, paper_cluster, ratio, run, save, summaries, tag_act

TANGRAMS = ("tangram", "tangram-wait", "tangram-paper")
POLICIES = (*TANGRAMS, "k8s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="256,512,1024,2048")
    args = ap.parse_args()
    started = time.perf_counter()
    batches = [int(b) for b in args.batches.split(",")]
    cluster = paper_cluster()
    doc: dict[str, object] = {}
    rows = []
    for b in batches:
        res = run(cluster, "ai-coding", b, POLICIES)
        doc[str(b)] = summaries(res)
        rows.append((b, res))
    print(
        "| batch | paper: k8s / tangram avg ACT | ours avg ACT tangram / wait / paper rule / k8s "
        "(s) | ours gain k8s / (tangram, wait, paper rule) | ours step tangram / wait / paper "
        "rule / k8s (s) | tool ACT (s) | test-run ACT (s) | test runs < 4 cores (on 1) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for i, (b, res) in enumerate(rows):
        s = {p: res[p].summary for p in POLICIES}
        paper = (
            "3.1× (smallest batch)"
            if i == 0
            else ("27.7× (largest)" if i == len(rows) - 1 else "between")
        )
        k = s["k8s"]["avg_act_s"]
        acts = " / ".join(f"{s[p]['avg_act_s']:.2f}" for p in POLICIES)
        gains = " / ".join(ratio(k, s[p]["avg_act_s"]) for p in TANGRAMS)
        steps = " / ".join(f"{s[p]['step_s']:.0f}" for p in POLICIES)
        tool = " / ".join(f"{tag_act(res[p], ['tool']):.2f}" for p in POLICIES)
        test = " / ".join(f"{tag_act(res[p], ['reward']):.1f}" for p in POLICIES)
        low = " / ".join(low_units(res[p]) for p in TANGRAMS)
        print(f"| {b} | {paper} | {acts} | {gains} | {steps} | {tool} | {test} | {low} |")
    _plot(rows)
    save("fig8_cpu", doc, started)


def _plot(rows: list) -> None:  # type: ignore[type-arg]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = [b for b, _ in rows]
    for p in POLICIES:
        ax.plot(xs, [r[p].summary["avg_act_s"] for _, r in rows], marker="o", label=p)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("RL batch size (trajectories)")
    ax.set_ylabel("avg ACT (s)")
    ax.set_title("AI coding, 15 x 256 cores")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(IMG / "fig8-cpu.png", dpi=110)


if __name__ == "__main__":
    main()
