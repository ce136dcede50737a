"""Shared helpers of the paper-reproduction scripts (bench/paper/*.py).

Every script runs the simulator at the paper's testbed scale (config/cluster-paper.toml),
prints a markdown table with the paper's number next to ours, writes its raw metrics to
``bench/paper/out/<name>.json`` and its plot to ``docs/img/<name>.png``, and reports its
wall time. Seeds are fixed, so reruns give identical numbers.

``tangram`` is the scheduler's default rule (``priced``: each elastic action's DoP priced by
the node's load, short calls passing waiting test runs); ``tangram-eft`` (``wait-eft``, the
previous default), ``tangram-wait`` and ``tangram-paper`` (the paper's Alg. 1-2 as read) are
the other selectable rules, run on the same trace where a script compares rules.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import tangram.sim.engine as _engine  # noqa: E402
from tangram.sim import generate, load_cluster, parse_policy, simulate  # noqa: E402
from tangram.sim.cluster import ClusterSpec  # noqa: E402
from tangram.sim.metrics import ActionRecord, SimResult, _stats  # noqa: E402
from tangram.sim.trace import TraceAction  # noqa: E402

OUT = ROOT / "bench" / "paper" / "out"
IMG = ROOT / "docs" / "img"
SEED = 0


def paper_cluster(judge_replicas: int | None = None) -> ClusterSpec:
    """The paper testbed; DeepSearch alone deploys its judge 5 times (paper §6 baselines)."""
    c = load_cluster(ROOT / "config" / "cluster-paper.toml")
    if judge_replicas is not None:
        services = tuple(
            replace(s, static_replicas=judge_replicas) if s.name == "judge" else s
            for s in c.services
        )
        c = replace(c, services=services)
    return c


_summarize = _engine.summarize


def _summarize_with_units(policy: str, records: Sequence[ActionRecord], *args: Any) -> SimResult:
    """``summarize`` plus ``units_by_tag``: how many actions of each tag got each amount.

    The DoP an elastic action started with is what the scheduler's replay rule decides
    (``wait-eft`` / ``wait`` / ``paper``), so the scripts record its distribution next to
    the ACT."""
    result = _summarize(policy, records, *args)
    hist: dict[str, dict[str, int]] = {}
    for r in records:
        if not r.failed:
            by = hist.setdefault(r.tag, {})
            by[str(r.units)] = by.get(str(r.units), 0) + 1
    result.summary["units_by_tag"] = {
        t: dict(sorted(h.items(), key=lambda kv: int(kv[0]))) for t, h in sorted(hist.items())
    }
    kinds: dict[str, list[ActionRecord]] = {}
    for r in records:
        kinds.setdefault(action_kind(r), []).append(r)
    result.summary["by_kind"] = {k: _stats(kinds[k]) for k in KINDS if k in kinds}
    if KEEP_TEST_ACTS:
        TEST_ACTS[policy] = {r.action_id: r.act_s for r in kinds.get("test", ()) if not r.failed}
    return result


# per action kind (issue 34, item 5): a 1-core tool call, a test run or reward suite (an
# elastic exec), an API call, a GPU service call (judge or teacher)
KINDS = ("tool", "test", "api", "gpu")


def action_kind(r: ActionRecord) -> str:
    if r.kind == "api":
        return "api"
    if r.kind == "service":
        return "gpu"
    return "test" if r.tag == "reward" else "tool"


def is_test(step: object) -> bool:
    """A trace step that is a test run (an elastic exec tagged ``reward``; in a record,
    ``action_kind`` "test")."""
    return isinstance(step, TraceAction) and step.kind == "exec" and step.tag == "reward"


# fig9's oracle reads every test run's ACT per policy: kept only when a script asks for it
KEEP_TEST_ACTS = False
TEST_ACTS: dict[str, dict[str, float]] = {}


_engine.summarize = _summarize_with_units  # type: ignore[assignment]


def started_below(result: SimResult, tag: str, units: int) -> int:
    """Number of completed ``tag`` actions that ran on fewer than ``units`` units."""
    hist = result.summary.get("units_by_tag", {}).get(tag, {})
    return sum(n for u, n in hist.items() if int(u) < units)


def run(
    cluster: ClusterSpec,
    workload: str,
    batch: int,
    policies: Iterable[str],
    seed: int = SEED,
    schedule_fn: Any = None,
) -> dict[str, SimResult]:
    """Each policy on one generated trace; ``schedule_fn``: the pass the engine calls
    instead of ``schedule`` (table1.py times it so)."""
    trace = generate(workload, cluster, batch, seed=seed)
    out: dict[str, SimResult] = {}
    for name in policies:
        t0 = time.perf_counter()
        out[name] = simulate(cluster, trace, parse_policy(name), schedule_fn=schedule_fn)
        if KEEP_TEST_ACTS:  # (kept under the policy's own name by summarize)
            TEST_ACTS[name] = TEST_ACTS.pop(out[name].policy)
        wall = time.perf_counter() - t0
        print(f"  [{workload} b={batch} {name}: {wall:.1f}s wall]", file=sys.stderr)
        out[name].summary.setdefault("wall_s_not_deterministic", round(wall, 2))
    return out


def low_units(result: SimResult, tag: str = "reward", units: int = 4) -> str:
    """``N (M)``: completed ``tag`` actions on fewer than ``units`` units (on 1 unit)."""
    return f"{started_below(result, tag, units)} ({started_below(result, tag, 2)})"


def tag_act(result: SimResult, tags: Sequence[str], field: str = "avg_act_s") -> float:
    """Action-weighted mean of ``field`` over the given tags."""
    by = result.summary["by_tag"]
    n = sum(by[t]["actions"] - by[t]["failed"] for t in tags if t in by)
    if not n:
        return 0.0
    return sum(by[t][field] * (by[t]["actions"] - by[t]["failed"]) for t in tags if t in by) / n


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b > 0 else "n/a"


def save(name: str, doc: dict[str, Any], started: float, quiet: bool = False) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    doc["wall_s"] = round(time.perf_counter() - started, 1)
    (OUT / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    if not quiet:  # (--json: stdout is the JSON document alone)
        print(f"\n{name}: wall time {doc['wall_s']} s")


def summaries(results: dict[str, SimResult]) -> dict[str, Any]:
    return {k: v.summary for k, v in results.items()}
