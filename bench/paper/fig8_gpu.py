"""Fig. 8 (GPU): GPUs tangram needs for the static deployment's ACT; GPU scalability.

Usage: python bench/paper/fig8_gpu.py [--gpus 4,8,12,16,24,32,40] [--batches 256,512,1024,2048]
(a) MOPD+Search, 10 services, batch 1024: ``static-services`` (10 × 4 GPUs = 40 GPUs) vs
    ``tangram`` (the default rule; "priced" and "wait-eft" replay GPU pools alike),
    ``tangram-wait`` (the "wait" rule) and ``tangram-paper`` (the paper's rule) on 4..40 GPUs;
    ACT is over the GPU actions (teacher + judge calls).
    Paper: the same ACT with 29% of the GPUs (71.2% saved).
(b) MOPD over batch sizes on 40 GPUs, the three tangram rules vs static-services. Paper: 18.1×
    faster at batch 2048 than the static SGLang deployment.
"""

from __future__ import annotations

import argparse
import time

from common import IMG, paper_cluster, ratio, run, save, summaries, tag_act

GPU_TAGS = ("teacher", "reward")
TANGRAMS = ("tangram", "tangram-wait", "tangram-paper")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="4,8,12,16,24,32,40")
    ap.add_argument("--batches", default="256,512,1024,2048")
    args = ap.parse_args()
    started = time.perf_counter()
    base = paper_cluster()
    doc: dict[str, object] = {"sweep": {}, "scalability": {}}
    static = run(base, "mopd+search", 1024, ("static-services",))["static-services"]
    target = tag_act(static, GPU_TAGS)
    doc["static"] = static.summary
    print(
        f"(a) MOPD+Search b=1024: static-services on {base.total_gpus} GPUs: "
        f"GPU-action avg ACT {target:.2f} s"
    )
    print(
        "\n| GPUs | share of static's 40 | GPU-action avg ACT (s) tangram / tangram-wait / "
        "tangram-paper | static / (tangram, wait, paper rule) | paper |"
    )
    print("|---|---|---|---|---|")
    sweep: list[tuple[int, dict[str, float]]] = []
    for g in (int(x) for x in args.gpus.split(",")):
        res = run(base.with_gpus(g), "mopd+search", 1024, TANGRAMS)
        acts = {p: tag_act(res[p], GPU_TAGS) for p in TANGRAMS}
        sweep.append((g, acts))
        doc["sweep"][str(g)] = summaries(res)  # type: ignore[index]
        cells = " / ".join(f"{acts[p]:.2f}" for p in TANGRAMS)
        gains = " / ".join(ratio(target, acts[p]) for p in TANGRAMS)
        print(
            f"| {g} | {g / base.total_gpus:.0%} | {cells} | {gains} | "
            "same ACT as static at 29% of the GPUs |"
        )
    need: dict[str, int | None] = {}
    for p in TANGRAMS:
        enough = [g for g, acts in sweep if acts[p] <= target]
        need[p] = min(enough) if enough else None
        print(
            f"{p}: fewest GPUs with ACT <= static: {need[p]} "
            f"({(need[p] or 0) / base.total_gpus:.0%} of 40; paper: 29%)"
        )
    doc["gpus_needed"] = need
    print(
        "\n(b) MOPD on 40 GPUs\n\n| batch | avg ACT (s) tangram / tangram-wait / tangram-paper | "
        "static avg ACT (s) | gain static / (tangram, wait, paper rule) | paper |"
    )
    print("|---|---|---|---|---|")
    scal = []
    for b in (int(x) for x in args.batches.split(",")):
        res = run(base, "mopd", b, (*TANGRAMS, "static-services"))
        acts = [res[p].summary["avg_act_s"] for p in TANGRAMS]
        st = res["static-services"].summary["avg_act_s"]
        scal.append((b, *acts, st))
        doc["scalability"][str(b)] = summaries(res)  # type: ignore[index]
        paper = "18.1× (vs SGLang)" if b == 2048 else ""
        print(
            f"| {b} | {' / '.join(f'{a:.2f}' for a in acts)} | {st:.2f} | "
            f"{' / '.join(ratio(st, a) for a in acts)} | {paper} |"
        )
    _plot(sweep, target, scal)
    save("fig8_gpu", doc, started)


def _plot(
    sweep: list[tuple[int, dict[str, float]]],
    target: float,
    scal: list[tuple[float, ...]],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    for p in TANGRAMS:
        style = "--" if p == "tangram-wait" else "-"  # equal to tangram on GPU pools: dashed
        a.plot([g for g, _ in sweep], [acts[p] for _, acts in sweep], marker="o", ls=style, label=p)
    a.axhline(target, color="tab:red", ls="--", label="static-services, 40 GPUs")
    a.set_xlabel("GPUs")
    a.set_ylabel("GPU-action avg ACT (s)")
    a.set_yscale("log")
    a.set_title("MOPD+Search, batch 1024")
    a.legend()
    a.grid(True, alpha=0.3)
    xs = [row[0] for row in scal]
    for i, label in enumerate((*TANGRAMS, "static-services"), start=1):
        style = "--" if label == "tangram-wait" else "-"
        b.plot(xs, [row[i] for row in scal], marker="o", ls=style, label=label)
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("RL batch size")
    b.set_ylabel("avg ACT (s)")
    b.set_title("MOPD, 40 GPUs")
    b.legend()
    b.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(IMG / "fig8-gpu.png", dpi=110)


if __name__ == "__main__":
    main()
