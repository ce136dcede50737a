"""Rendering of simulation results: a table for people, JSON for programs, optional plots."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from tangram.sim.metrics import SimResult

COLUMNS = (
    ("policy", "{}", 18),
    ("actions", "{}", 8),
    ("failed", "{}", 6),
    ("avg_act_s", "{:.3f}", 10),
    ("p50_act_s", "{:.3f}", 10),
    ("p99_act_s", "{:.3f}", 10),
    ("avg_queue_s", "{:.3f}", 11),
    ("avg_restore_s", "{:.3f}", 13),
    ("avg_exec_s", "{:.3f}", 10),
    ("step_s", "{:.1f}", 9),
)


def to_json(results: Sequence[SimResult], extra: Mapping[str, Any] | None = None) -> str:
    """``{"policies": {name: summary}, ...extra}`` with a stable key order."""
    doc: dict[str, Any] = {"policies": {r.policy: r.summary for r in results}}
    if extra:
        doc.update(extra)
    return json.dumps(doc, indent=1)


def table(results: Sequence[SimResult]) -> str:
    head = " ".join(f"{name:>{w}}" for name, _, w in COLUMNS)
    lines = [head]
    for r in results:
        row = {"policy": r.policy, **r.summary}
        lines.append(" ".join(f"{fmt.format(row[name]):>{w}}" for name, fmt, w in COLUMNS))
    lines.append("")
    lines.append("utilisation (unit-seconds busy / reserved):")
    for r in results:
        busy = r.summary["busy_unit_s"]
        reserved = r.summary["reserved_unit_s"]
        parts = [
            f"{k}={busy.get(k, 0.0):.0f}/{reserved.get(k, 0.0):.0f}"
            for k in sorted(set(busy) | set(reserved))
        ]
        lines.append(f"  {r.policy:<18} {' '.join(parts)}")
    tags = sorted({t for r in results for t in r.summary["by_tag"]})
    if tags:
        lines.append("")
        lines.append("avg ACT by action tag (queue + restore + exec):")
        for r in results:
            by = r.summary["by_tag"]
            parts = [
                f"{t}={by[t]['avg_act_s']:.2f}s ({by[t]['avg_queue_s']:.2f}+"
                f"{by[t]['avg_restore_s']:.2f}+{by[t]['avg_exec_s']:.2f})"
                for t in tags
                if t in by
            ]
            lines.append(f"  {r.policy:<18} {'  '.join(parts)}")
    return "\n".join(lines)


def plot(results: Sequence[SimResult], path: str, title: str = "") -> None:
    """ACT CDF per policy (log scale) and mean RL step time per policy; needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        acts = sorted(max(a, 1e-4) for a in r.acts)
        n = len(acts)
        if n:
            ax1.plot(acts, [(i + 1) / n for i in range(n)], label=r.policy)
    ax1.set_xscale("log")
    ax1.set_xlabel("action completion time (s)")
    ax1.set_ylabel("CDF")
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize=8)
    names = [r.policy for r in results]
    ax2.bar(names, [r.summary["step_s"] for r in results], color="tab:blue")
    ax2.set_ylabel("mean RL step time (s)")
    ax2.tick_params(axis="x", rotation=30, labelsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
