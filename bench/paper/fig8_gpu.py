"""Fig. 8 (GPU): GPUs tangram needs for the static deployment's ACT; GPU scalability.

Usage: python bench/paper/fig8_gpu.py [--gpus 4,8,12,16,24,32,40] [--batches 256,512,1024,2048]
(a) MOPD+Search, 10 services, batch 1024: ``static-services`` (10 × 4 GPUs = 40 GPUs) vs
    ``tangram`` (the default rule; "priced" and "wait-eft" replay GPU pools alike),
    ``tangram-wait`` (the "wait" rule) and ``tangram-paper`` (the paper's rule) on 4..40 GPUs;
    ACT is over the GPU actions (teacher + judge calls).
    Paper: the same ACT with 29% of the GPUs (71.2% saved).
(b) MOPD over batch sizes on 40 GPUs, the three tangram rules vs static-services. Paper: 18.1×
    faster at batch 2048 than the static SGLang deployment.
(a) and (b) also run the static deployment batching as SGLang does and tangram batching as
    the daemon does (issue 33 item 5), at batch gains 1 and 2 (below).
(c) ``--baselines`` (issue 33 item 5): the static deployment batching as SGLang does
    (continuous batching, ``static_max_batch`` calls per replica, per-call time from the same
    service time model, see ``tangram.sim.baselines``) in three replica shapes of the same
    40 GPUs (4×1, 2×2, 1×4 GPUs per service), at teacher popularity skews 1×, 10×, 1000×
    (MOPD+Search, batch 1024; ``--workload mopd``: the teachers alone): the fewest GPUs on
    which ``tangram`` reaches the baseline's GPU-action ACT, and the saving; once without
    batching and once batching as the daemon does (a placed call takes up to
    ``max_batch - 1`` queued calls to its service along, one pass timed by the same model
    at the same gain, ``tangram.sim.gpubatch``). Writes
    ``bench/paper/out/fig8_gpu_baselines.json``; ``--baselines-only`` skips (a) and (b).

Batch gain: a full batch's throughput per GPU over one call alone on one GPU, the same for
the static replicas and for tangram's passes. Gain 1 is the service time model's own (batching
only removes the multi-GPU loss E(g)); gain 2 is assumed, not measured.
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
# (c): tangram's GPU counts, 4 to 40: whole 8-GPU nodes plus a node of 1, 2 or 4 GPUs
SWEEP = sorted({4} | {g for k in range(1, 6) for r in (0, 1, 2, 4) if (g := 8 * k + r) <= 40})
MAX_BATCH = 64  # calls one replica batches (SGLang's running requests, assumed for prefill)
# a full batch's throughput per GPU over one call alone on one GPU: 1 = the service time
# model's own (batching only removes the multi-GPU loss E(g)); 2 = assumed batching gain
BATCH_GAINS = (1.0, 2.0)


def batching(base: ClusterSpec, who: str, max_batch: int, gain: float) -> ClusterSpec:
    """``base`` with ``who`` ("static" or "tangram") batching ``max_batch`` calls at ``gain``."""
    rules = replace(base.baselines, static_batch_gain=gain)
    if who == "static":
        return replace(base, baselines=replace(rules, static_max_batch=max_batch))
    services = tuple(replace(s, max_batch=max_batch) for s in base.services)
    return replace(base, services=services, baselines=rules)


def _sim(cluster: ClusterSpec, trace: list[Any], policy: str) -> Any:
    t0 = time.perf_counter()
    result = simulate(cluster, trace, parse_policy(policy))
    result.summary.setdefault("wall_s_not_deterministic", round(time.perf_counter() - t0, 2))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="4,8,12,16,24,32,40")
    ap.add_argument("--batches", default="256,512,1024,2048")
    ap.add_argument("--baselines", action="store_true", help="add table (c)")
    ap.add_argument("--baselines-only", action="store_true", help="only table (c)")
    ap.add_argument("--skews", default=",".join(f"{s:g}" for s in SKEWS))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", default=",".join(map(str, SWEEP)))
    ap.add_argument("--batch", type=int, default=1024, help="(c): RL batch size")
    ap.add_argument("--workload", default="mopd+search", help="(c): mopd+search or mopd")
    ap.add_argument("--max-batch", type=int, default=MAX_BATCH)
    ap.add_argument(
        "--tangram-max-batch",
        type=int,
        default=0,
        help="(c): calls a tangram pass takes (0: --max-batch)",
    )
    ap.add_argument("--full-sweep", action="store_true", help="(c): run every GPU count")
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
            args.tangram_max_batch or args.max_batch,
            args.full_sweep,
        )
        save(args.out, doc, started)
        if args.baselines_only:
            return
    started = time.perf_counter()
    base = paper_cluster()
    gains = [float(x) for x in args.batch_gains.split(",")]
    mb = args.max_batch
    batched = [f"gain{g:g}" for g in gains]
    doc: dict[str, object] = {
        "sweep": {},
        "scalability": {},
        "max_batch": mb,
        "batch_gains": gains,
        "static_batching": {},
    }
    trace = generate("mopd+search", base, 1024, seed=0)
    static = run(base, "mopd+search", 1024, ("static-services",))["static-services"]
    target = tag_act(static, GPU_TAGS)
    doc["static"] = static.summary
    targets = {"serial": target}
    for g, name in zip(gains, batched, strict=True):
        res = _sim(batching(base, "static", mb, g), trace, "static-services")
        doc["static_batching"][name] = res.summary  # type: ignore[index]
        targets[name] = tag_act(res, GPU_TAGS)
    print(
        f"(a) MOPD+Search b=1024: static-services on {base.total_gpus} GPUs: GPU-action avg "
        f"ACT {target:.2f} s serial, "
        + ", ".join(f"{targets[n]:.2f} s batching at {n}" for n in batched)
        + f" (at most {mb} calls per replica)"
    )
    cols = [*TANGRAMS, *(f"tangram+batch-{n}" for n in batched)]
    print(
        f"\n| GPUs | share of static's 40 | GPU-action avg ACT (s) {' / '.join(cols)} "
        "| static serial / (tangram, wait, paper rule) | paper |"
    )
    print("|---|---|---|---|---|")
    sweep: list[tuple[int, dict[str, float]]] = []
    for g in (int(x) for x in args.gpus.split(",")):
        res = run(base.with_gpus(g), "mopd+search", 1024, TANGRAMS)
        for gain, name in zip(gains, batched, strict=True):
            res[f"tangram+batch-{name}"] = _sim(
                batching(base, "tangram", mb, gain).with_gpus(g), trace, "tangram"
            )
        acts = {p: tag_act(res[p], GPU_TAGS) for p in cols}
        sweep.append((g, acts))
        doc["sweep"][str(g)] = summaries(res)  # type: ignore[index]
        cells = " / ".join(f"{acts[p]:.2f}" for p in cols)
        gains_s = " / ".join(ratio(target, acts[p]) for p in TANGRAMS)
        print(
            f"| {g} | {g / base.total_gpus:.0%} | {cells} | {gains_s} | "
            "same ACT as static at 29% of the GPUs |",
            flush=True,
        )
    need: dict[str, int | None] = {}
    pairs = [(p, "serial") for p in TANGRAMS]
    pairs += [(p, n) for n in batched for p in ("tangram", f"tangram+batch-{n}")]
    for p, against in pairs:
        fits = fewest_gpus({g: acts[p] for g, acts in sweep}, targets[against])
        key = p if against == "serial" else f"{p} vs static batching {against}"
        need[key] = fits
        print(
            f"{key}: fewest GPUs with GPU-action ACT <= static ({targets[against]:.2f} s): "
            f"{fits} ({(fits or 0) / base.total_gpus:.0%} of 40; paper: 29%)"
        )
    doc["gpus_needed"] = need
    doc["static_targets"] = {k: round(v, 3) for k, v in targets.items()}
    scols = ["static", *(f"static batching {n}" for n in batched)]
    print(
        f"\n(b) MOPD on 40 GPUs\n\n| batch | avg ACT (s) {' / '.join(cols)} | "
        f"avg ACT (s) {' / '.join(scols)} | gain static / (tangram, wait, paper rule) | "
        "gain static batching / tangram batching, same gain | paper |"
    )
    print("|---|---|---|---|---|---|")
    scal = []
    for b in (int(x) for x in args.batches.split(",")):
        res = run(base, "mopd", b, (*TANGRAMS, "static-services"))
        mtrace = generate("mopd", base, b, seed=0)
        for gain, name in zip(gains, batched, strict=True):
            res[f"tangram+batch-{name}"] = _sim(
                batching(base, "tangram", mb, gain), mtrace, "tangram"
            )
            res[f"static batching {name}"] = _sim(
                batching(base, "static", mb, gain), mtrace, "static-services"
            )
        acts = [res[p].summary["avg_act_s"] for p in cols]
        st = [res[p if p != "static" else "static-services"].summary["avg_act_s"] for p in scols]
        scal.append((b, *acts, *st))
        doc["scalability"][str(b)] = summaries(res)  # type: ignore[index]
        paper = "18.1× (vs SGLang)" if b == 2048 else ""
        same = " / ".join(
            ratio(
                res[f"static batching {n}"].summary["avg_act_s"],
                res[f"tangram+batch-{n}"].summary["avg_act_s"],
            )
            for n in batched
        )
        print(
            f"| {b} | {' / '.join(f'{a:.2f}' for a in acts)} | "
            f"{' / '.join(f'{a:.2f}' for a in st)} | "
            f"{' / '.join(ratio(st[0], a) for a in acts[: len(TANGRAMS)])} | {same} | {paper} |",
            flush=True,
        )
    _plot(sweep, targets, scal, cols, scols)
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


class Sweep:
    """tangram's GPU-action ACT over the sweep's GPU counts, each run once when first asked.

    ``fewest(target)`` bisects the sweep (tangram's ACT falls as GPUs are added; every full
    sweep run so far was strictly decreasing), or runs every count with ``full``."""

    def __init__(self, base: ClusterSpec, trace: list[Any], sweep: list[int], full: bool) -> None:
        self.base, self.trace, self.sweep, self.full = base, trace, sorted(sweep), full
        self.acts: dict[int, float] = {}

    def act(self, g: int) -> float:
        if g not in self.acts:
            self.acts[g] = _tangram_act(self.base, self.trace, g)
        return self.acts[g]

    def fewest(self, target: float) -> int | None:
        if self.full:
            return fewest_gpus({g: self.act(g) for g in self.sweep}, target)
        lo, hi = 0, len(self.sweep)  # the answer's index lies in [lo, hi]; hi: none fits
        while lo < hi:
            mid = (lo + hi) // 2
            if self.act(self.sweep[mid]) <= target:
                hi = mid
            else:
                lo = mid + 1
        return self.sweep[lo] if lo < len(self.sweep) else None

    def table(self) -> dict[str, float]:
        return {str(g): round(a, 3) for g, a in sorted(self.acts.items())}


def _called(trace: list[Any]) -> set[str]:
    return {a.template.service for t in trace for a in t.actions()} - {None}


def _cell(acts: Sweep, target: float, total: int, every: int) -> dict[str, Any]:
    need = acts.fewest(target)
    return {
        "tangram_gpus": need,
        "saving": None if need is None else round(1 - need / total, 3),
        "saving_vs_every_service": None if need is None else round(1 - need / every, 3),
    }


def _fmt(cells: list[dict[str, Any]], key: str, top: int) -> str:
    if key == "tangram_gpus":
        return " / ".join(f"> {top}" if c[key] is None else str(c[key]) for c in cells)
    return " / ".join("< 0%" if c[key] is None else f"{c[key]:.0%}" for c in cells)


def baselines_table(
    skews: list[float],
    shapes: list[str],
    sweep: list[int],
    batch: int,
    max_batch: int,
    gains: list[float],
    workload: str = "mopd+search",
    tangram_max_batch: int = 0,
    full: bool = False,
) -> dict[str, Any]:
    """Table (c): per skew, tangram's ACT over the GPU sweep without batching and batching
    (``max_batch`` calls a pass, at each batch gain); per shape, the static deployment's ACT
    one call at a time and batching (one column per batch gain), and the fewest GPUs of the
    sweep on which tangram's ACT is no worse: tangram without batching against every static
    column, tangram batching against the static column of the same gain (serial: gain 1).
    ``tangram_max_batch``: the calls a tangram pass takes (0: ``max_batch``). tangram runs on
    the counts the bisection asks for (``full``: on every count of the sweep)."""
    tmb = tangram_max_batch or max_batch
    base = paper_cluster()
    modes = [("serial", 1, 1.0)] + [(f"batching-gain{g:g}", max_batch, g) for g in gains]
    tgains = sorted({g for _, _, g in modes})
    doc: dict[str, Any] = {
        "workload": workload,
        "batch": batch,
        "static_gpus": {},
        "max_batch": max_batch,
        "tangram_max_batch": tmb,
        "batch_gains": gains,
        "modes": [m for m, _, _ in modes],
        "sweep": sweep,
        "rows": [],
        "tangram_act": {},
        "tangram_batching_act": {},
    }
    names = " / ".join(m for m, _, _ in modes)
    print(
        f"(c) {workload} b={batch}: static deployments (4 GPUs per called service) vs tangram on "
        f"{','.join(map(str, sweep))} GPUs; batching: at most {max_batch} calls per replica "
        f"(static: continuous), {tmb} per pass (tangram)\n"
    )
    print(
        f"| skew | shape (static GPUs) | static GPU-action ACT (s) {names} "
        "| tangram GPUs at equal ACT | GPU saving | tangram batching GPUs (same gain) "
        "| GPU saving, tangram batching | the same vs every service deployed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    # a real static deployment serves every service the workload may call (its uniform
    # trace calls them all); the simulated one deploys only those its trace calls
    every = 4 * len(_called(generate(workload, base, batch, seed=0, teacher_skew=1.0)))
    doc["static_gpus_every_service"] = every
    for skew in skews:
        key = f"{skew:g}"
        trace = generate(workload, base, batch, seed=0, teacher_skew=skew)
        # static-services deploys the services the trace calls: 4 GPUs each, in every shape
        total = 4 * len(_called(trace))
        doc["static_gpus"][key] = total
        acts = Sweep(base, trace, sweep, full)
        bacts = {
            gain: Sweep(batching(base, "tangram", tmb, gain), trace, sweep, full) for gain in tgains
        }
        entries = []
        for shape in shapes:
            entry: dict[str, Any] = {"skew": skew, "shape": shape}
            for mode, mb, gain in modes:
                static = simulate(
                    shaped(base, shape, mb, gain), trace, parse_policy("static-services")
                )
                target = tag_act(static, GPU_TAGS)
                entry[mode] = {
                    "static_act_s": round(target, 3),
                    "static_summary": static.summary,
                    **_cell(acts, target, total, every),
                    "tangram_batching": {"gain": gain, **_cell(bacts[gain], target, total, every)},
                }
            entries.append(entry)
        doc["tangram_act"][key] = acts.table()
        doc["tangram_batching_act"][key] = {f"gain{g:g}": bacts[g].table() for g in tgains}
        for entry in entries:
            shape = entry["shape"]
            doc["rows"].append(entry)
            cells = [entry[m] for m, _, _ in modes]
            bcells = [c["tangram_batching"] for c in cells]
            act = " / ".join(f"{c['static_act_s']:.1f}" for c in cells)
            top = max(sweep)
            print(
                f"| {skew:g}x | {shape} ({total}) | {act} | {_fmt(cells, 'tangram_gpus', top)} "
                f"| {_fmt(cells, 'saving', top)} | {_fmt(bcells, 'tangram_gpus', top)} "
                f"| {_fmt(bcells, 'saving', top)} "
                f"| {_fmt(bcells, 'saving_vs_every_service', top)} |",
                flush=True,
            )
    return doc


def _plot(
    sweep: list[tuple[int, dict[str, float]]],
    targets: dict[str, float],
    scal: list[tuple[float, ...]],
    cols: list[str],
    scols: list[str],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for p in cols:
        style = "--" if p == "tangram-wait" else (":" if "batch" in p else "-")
        a.plot([g for g, _ in sweep], [acts[p] for _, acts in sweep], marker="o", ls=style, label=p)
    for i, (name, act) in enumerate(targets.items()):
        label = "static, 40 GPUs" if name == "serial" else f"static batching {name}"
        a.axhline(
            act, color=("tab:red", "tab:brown", "tab:pink", "black")[i % 4], ls="--", label=label
        )
    a.set_xlabel("GPUs")
    a.set_ylabel("GPU-action avg ACT (s)")
    a.set_yscale("log")
    a.set_title("MOPD+Search, batch 1024")
    a.legend(fontsize=7)
    a.grid(True, alpha=0.3)
    xs = [row[0] for row in scal]
    for i, label in enumerate((*cols, *scols), start=1):
        style = "--" if label == "tangram-wait" else (":" if "batch" in label else "-")
        b.plot(xs, [row[i] for row in scal], marker="o", ls=style, label=label)
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("RL batch size")
    b.set_ylabel("avg ACT (s)")
    b.set_title("MOPD, 40 GPUs")
    b.legend(fontsize=7)
    b.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(IMG / "fig8-gpu.png", dpi=110)


if __name__ == "__main__":
    main()
