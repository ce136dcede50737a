"""Fig. 8 (GPU): GPUs tangram needs for the static deployment's ACT; GPU scalability.

Usage: python bench/paper/fig8_gpu.py [--gpus 4,8,12,16,24,32,40] [--batches 256,512,1024,2048]
(a) MOPD+Search, 10 services, batch 1024: ``static-services`` (10 × 4 GPUs = 40 GPUs) vs
    ``tangram`` on 8..40 GPUs; ACT is over the GPU actions (teacher + judge calls). Paper:
    the same ACT with 29% of the GPUs (71.2% saved).
(b) MOPD over batch sizes on 40 GPUs, tangram vs static-services. Paper: 18.1× faster at
    batch 2048 than the static SGLang deployment.
"""

from __future__ import annotations

import argparse
import time

from common import IMG, paper_cluster, ratio, run, save, summaries, tag_act

GPU_TAGS = ("teacher", "reward")


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
    print("\n| GPUs | share of static's 40 | tangram GPU-action avg ACT (s) | vs static |")
    print("|---|---|---|---|")
    sweep = []
    for g in (int(x) for x in args.gpus.split(",")):
        res = run(base.with_gpus(g), "mopd+search", 1024, ("tangram",))["tangram"]
        act = tag_act(res, GPU_TAGS)
        sweep.append((g, act))
        doc["sweep"][str(g)] = res.summary  # type: ignore[index]
        print(f"| {g} | {g / base.total_gpus:.0%} | {act:.2f} | {ratio(target, act)} |")
    enough = [g for g, act in sweep if act <= target]
    need = min(enough) if enough else None
    print(
        f"\nfewest GPUs with ACT <= static: {need} "
        f"({(need or 0) / base.total_gpus:.0%} of 40; paper: 29%)"
    )
    doc["gpus_needed"] = need
    print("\n(b) MOPD on 40 GPUs\n\n| batch | tangram avg ACT (s) | static avg ACT (s) | gain |")
    print("|---|---|---|---|")
    scal = []
    for b in (int(x) for x in args.batches.split(",")):
        res = run(base, "mopd", b, ("tangram", "static-services"))
        t, s = res["tangram"].summary, res["static-services"].summary
        scal.append((b, t["avg_act_s"], s["avg_act_s"]))
        doc["scalability"][str(b)] = summaries(res)  # type: ignore[index]
        print(
            f"| {b} | {t['avg_act_s']:.2f} | {s['avg_act_s']:.2f} | "
            f"{ratio(s['avg_act_s'], t['avg_act_s'])} |"
        )
    _plot(sweep, target, scal)
    save("fig8_gpu", doc, started)


def _plot(
    sweep: list[tuple[int, float]], target: float, scal: list[tuple[int, float, float]]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    a.plot([g for g, _ in sweep], [x for _, x in sweep], marker="o", label="tangram")
    a.axhline(target, color="tab:red", ls="--", label="static-services, 40 GPUs")
    a.set_xlabel("GPUs")
    a.set_ylabel("GPU-action avg ACT (s)")
    a.set_yscale("log")
    a.set_title("MOPD+Search, batch 1024")
    a.legend()
    a.grid(True, alpha=0.3)
    xs = [x for x, _, _ in scal]
    b.plot(xs, [t for _, t, _ in scal], marker="o", label="tangram")
    b.plot(xs, [s for _, _, s in scal], marker="o", label="static-services")
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
