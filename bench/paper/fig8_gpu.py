"""Fig. 8 (GPU): GPUs tangram needs for the static deployment's ACT; GPU scalability.

Usage: python bench/paper/fig8_gpu.py [--gpus 4,8,12,16,24,32,40] [--batches 256,512,1024,2048]
(a) MOPD+Search, 10 services, batch 1024: ``static-services`` (10 × 4 GPUs = 40 GPUs) vs
    ``tangram`` (the default rule; "priced" and "wait-eft" replay GPU pools alike),
    ``tangram-wait`` (the "wait" rule) and ``tangram-paper`` (the paper's rule) on 4..40 GPUs;
    ACT is over the GPU actions (teacher + judge calls).
    Paper: the same ACT with 29% of the GPUs (71.2% saved).
(b) MOPD over batch sizes on 40 GPUs, the three tangram rules vs static-services. Paper: 18.1×
    faster at batch 2048 than the static SGLang deployment.
(c) ``--baselines`` (issue 33 item 5): the static deployment batching as SGLang does
    (continuous batching, ``static_max_batch`` calls per replica, per-call time from the same
    service time model, see ``tangram.sim.baselines``) in three replica shapes of the same
    40 GPUs (4×1, 2×2, 1×4 GPUs per service), at teacher popularity skews 1×, 10×, 1000×
    (MOPD+Search, batch 1024; ``--workload mopd``: the teachers alone): the fewest GPUs on
    which ``tangram`` (which does not batch) reaches the baseline's GPU-action ACT, and the
    saving. Writes
    ``bench/paper/out/fig8_gpu_baselines.json``; ``--baselines-only`` skips (a) and (b).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Any

from common import IMG, paper_cluster, ratio, run, save, summaries, tag_act

from tangram.sim import generate, parse_policy, simulate
from tangram.sim.cluster import ClusterSpec

GPU_TAGS = ("teacher", "reward")
TANGRAMS = ("tangram", "tangram-wait", "tangram-paper")
SHAPES = {"4x1": (4, 1), "2x2": (2, 2), "1x4": (1, 4)}  # replicas x GPUs per service
SKEWS = (1.0, 10.0, 1000.0)
MAX_BATCH = 64  # calls one replica batches (SGLang's running requests, assumed for prefill)
# a full batch's throughput per GPU over one call alone on one GPU: 1 = the service time
# model's own (batching only removes the multi-GPU loss E(g)); 2 = assumed batching gain
BATCH_GAINS = (1.0, 2.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="4,8,12,16,24,32,40")
    ap.add_argument("--batches", default="256,512,1024,2048")
    ap.add_argument("--baselines", action="store_true", help="add table (c)")
    ap.add_argument("--baselines-only", action="store_true", help="only table (c)")
    ap.add_argument("--skews", default=",".join(f"{s:g}" for s in SKEWS))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", default=",".join(str(g) for g in range(4, 41, 4)))
    ap.add_argument("--batch", type=int, default=1024, help="(c): RL batch size")
    ap.add_argument("--workload", default="mopd+search", help="(c): mopd+search or mopd")
    ap.add_argument("--max-batch", type=int, default=MAX_BATCH)
    ap.add_argument("--batch-gains", default=",".join(f"{g:g}" for g in BATCH_GAINS))
    ap.add_argument("--out", default="fig8_gpu_baselines", help="(c): JSON name in out/")
    args = ap.parse_args()
    if args.baselines or args.baselines_only:
        started = time.perf_counter()
        doc = baselines_table(
            [float(x) for x in args.skews.split(",")],
            args.shapes.split(","),
            [int(x) for x in args.sweep.split(",")],
            args.batch,
            args.max_batch,
            [float(x) for x in args.batch_gains.split(",")],
            args.workload,
        )
        save(args.out, doc, started)
        if args.baselines_only:
            return
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


def shaped(base: ClusterSpec, shape: str, max_batch: int, gain: float) -> ClusterSpec:
    """Every service deployed as ``replicas x gpus`` static replicas, batching ``max_batch``."""
    replicas, gpus = SHAPES[shape]
    services = tuple(replace(s, static_gpus=gpus, static_replicas=replicas) for s in base.services)
    rules = replace(base.baselines, static_max_batch=max_batch, static_batch_gain=gain)
    return replace(base, services=services, baselines=rules)


def fewest_gpus(acts: dict[int, float], target: float) -> int | None:
    """The fewest GPUs of the sweep whose ACT is at most ``target`` (None: no count)."""
    enough = [g for g, act in acts.items() if act <= target]
    return min(enough) if enough else None


def _tangram_act(base: ClusterSpec, trace: list[Any], g: int) -> float:
    """tangram's GPU-action ACT on ``g`` GPUs (a sweep point: whole nodes plus 1, 2 or 4)."""
    return tag_act(simulate(base.with_gpus(g), trace, parse_policy("tangram")), GPU_TAGS)


def _called(trace: list[Any]) -> set[str]:
    return {a.template.service for t in trace for a in t.actions()} - {None}


def baselines_table(
    skews: list[float],
    shapes: list[str],
    sweep: list[int],
    batch: int,
    max_batch: int,
    gains: list[float],
    workload: str = "mopd+search",
) -> dict[str, Any]:
    """Table (c): per skew, tangram's ACT over the GPU sweep; per shape, the static
    deployment's ACT one call at a time and batching (one column per batch gain), and the
    fewest GPUs of the sweep on which tangram's ACT is no worse."""
    base = paper_cluster()
    modes = [("serial", 1, 1.0)] + [(f"batching-gain{g:g}", max_batch, g) for g in gains]
    doc: dict[str, Any] = {
        "workload": workload,
        "batch": batch,
        "static_gpus": {},
        "max_batch": max_batch,
        "batch_gains": gains,
        "modes": [m for m, _, _ in modes],
        "sweep": sweep,
        "rows": [],
        "tangram_act": {},
    }
    names = " / ".join(m for m, _, _ in modes)
    print(
        f"(c) {workload} b={batch}: static deployments (4 GPUs per called service) vs tangram on "
        f"{','.join(map(str, sweep))} GPUs; batching: continuous, at most {max_batch} calls "
        "per replica\n"
    )
    print(
        f"| skew | shape (static GPUs) | static GPU-action ACT (s) {names} "
        "| tangram GPUs at equal ACT | GPU saving | saving vs every service deployed |"
    )
    print("|---|---|---|---|---|---|")
    # a real static deployment serves every service the workload may call (its uniform
    # trace calls them all); the simulated one deploys only those its trace calls
    every = _called(generate(workload, base, batch, seed=0, teacher_skew=1.0))
    doc["static_gpus_every_service"] = 4 * len(every)
    for skew in skews:
        trace = generate(workload, base, batch, seed=0, teacher_skew=skew)
        # static-services deploys the services the trace calls: 4 GPUs each, in every shape
        total = 4 * len(_called(trace))
        doc["static_gpus"][f"{skew:g}"] = total
        acts = {g: _tangram_act(base, trace, g) for g in sweep}
        doc["tangram_act"][f"{skew:g}"] = {str(g): round(a, 3) for g, a in sorted(acts.items())}
        for shape in shapes:
            entry: dict[str, Any] = {"skew": skew, "shape": shape}
            for mode, mb, gain in modes:
                cluster = shaped(base, shape, mb, gain)
                static = simulate(cluster, trace, parse_policy("static-services"))
                target = tag_act(static, GPU_TAGS)
                need = fewest_gpus(acts, target)
                entry[mode] = {
                    "static_act_s": round(target, 3),
                    "static_summary": static.summary,
                    "tangram_gpus": need,
                    "saving": None if need is None else round(1 - need / total, 3),
                    "saving_vs_every_service": None
                    if need is None
                    else round(1 - need / (4 * len(every)), 3),
                }
            doc["rows"].append(entry)
            cells = [entry[m] for m, _, _ in modes]
            gpus = " / ".join(
                f"> {max(sweep)}" if c["tangram_gpus"] is None else str(c["tangram_gpus"])
                for c in cells
            )
            saved = " / ".join(
                "< 0%" if c["saving"] is None else f"{c['saving']:.0%}" for c in cells
            )
            every_saved = " / ".join(
                "< 0%" if c["saving"] is None else f"{c['saving_vs_every_service']:.0%}"
                for c in cells
            )
            act = " / ".join(f"{c['static_act_s']:.1f}" for c in cells)
            print(
                f"| {skew:g}x | {shape} ({total}) | {act} | {gpus} | {saved} | {every_saved} |",
                flush=True,
            )
    return doc


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
