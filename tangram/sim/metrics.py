"""Per-policy metrics of a simulated run (docs/design.md §8 output fields) and their JSON form.

Every float is rounded to microseconds so that the same run prints byte-identical JSON.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ActionRecord:
    action_id: str
    tag: str
    kind: str
    task: str
    queue_s: float  # submission → units granted (pod wait, retries and back-off included)
    restore_s: float  # GPU service restore from host memory
    exec_s: float
    units: int
    failed: bool
    job: str = "default"
    start_s: float = 0.0  # simulated time its units were granted (submission + queue_s)

    @property
    def act_s(self) -> float:
        return self.queue_s + self.restore_s + self.exec_s


@dataclass(slots=True)
class SimResult:
    policy: str
    summary: dict[str, Any]
    acts: list[float] = field(default_factory=list)  # ACT of every completed action
    steps: dict[str, list[float]] = field(default_factory=dict)


def r6(x: float) -> float:
    return round(x, 6) if math.isfinite(x) else x


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    n = len(sorted_values)
    return sorted_values[min(n - 1, max(0, math.ceil(q * n) - 1))]


def _stats(records: Sequence[ActionRecord]) -> dict[str, Any]:
    ok = [r for r in records if not r.failed]
    acts = sorted(r.act_s for r in ok)
    n = len(ok)

    def mean(xs: Sequence[float]) -> float:
        return r6(sum(xs) / len(xs)) if xs else 0.0

    return {
        "actions": len(records),
        "failed": len(records) - n,
        "avg_act_s": mean(acts),
        "p50_act_s": r6(percentile(acts, 0.50)),
        "p99_act_s": r6(percentile(acts, 0.99)),
        "avg_queue_s": mean([r.queue_s for r in ok]),
        "avg_restore_s": mean([r.restore_s for r in ok]),
        "avg_exec_s": mean([r.exec_s for r in ok]),
        "avg_units": mean([float(r.units) for r in ok]),
    }


def summarize(
    policy: str,
    records: Sequence[ActionRecord],
    steps: Mapping[str, list[float]],
    busy: Mapping[str, float],
    reserved: Mapping[str, float],
    makespan: float,
) -> SimResult:
    summary = _stats(records)
    all_steps = [s for task in sorted(steps) for s in steps[task]]
    summary["step_s"] = r6(sum(all_steps) / len(all_steps)) if all_steps else 0.0
    summary["steps_by_task"] = {t: [r6(s) for s in steps[t]] for t in sorted(steps)}
    summary["makespan_s"] = r6(makespan)
    summary["busy_unit_s"] = {k: r6(busy[k]) for k in sorted(busy)}
    summary["reserved_unit_s"] = {k: r6(reserved[k]) for k in sorted(reserved)}
    tags: dict[str, list[ActionRecord]] = {}
    for r in records:
        tags.setdefault(r.tag, []).append(r)
    summary["by_tag"] = {t: _stats(tags[t]) for t in sorted(tags)}
    jobs: dict[str, list[ActionRecord]] = {}
    for r in records:
        jobs.setdefault(r.job, []).append(r)
    if jobs and (len(jobs) > 1 or "default" not in jobs):  # one default job: no by_job
        summary["by_job"] = {j: _stats(jobs[j]) for j in sorted(jobs)}
    acts = [r.act_s for r in records if not r.failed]
    return SimResult(policy, summary, acts, {t: list(v) for t, v in steps.items()})
