"""The simulator leaves out the queues of quiet CPU nodes (``Decision.quiet``) with the same
decisions: every action's start, node, cores and end, the step times and the summary are
those of the run that passes every queue (``Engine(quiet=False)``), on cases where queues
were left out."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from sim_starts import logged

from tangram.sim import generate, parse_policy
from tangram.sim.cluster import ClusterSpec, CpuNodeSpec, load_cluster

ROOT = Path(__file__).resolve().parents[1]


def _cluster(nodes: int) -> ClusterSpec:
    base = load_cluster(ROOT / "config" / "cluster-mixed.toml")
    return replace(base, cpu_nodes=(CpuNodeSpec(count=nodes, cores=64, numa=2, mem_gb=512.0),))


def _run(cluster: ClusterSpec, batch: int, policy: str, quiet: bool) -> tuple[Any, ...]:
    trace = generate("ai-coding", cluster, batch, seed=0)
    engine, starts = logged(cluster, trace, parse_policy(policy), quiet=quiet)
    result = engine.run()
    steps = sorted(engine.step_durations.items())
    return starts, engine.records, steps, result.summary, engine.quiet_skips


@pytest.mark.parametrize(("nodes", "batch", "policy"), [(2, 512, "tangram")])
def test_quiet_nodes_left_out_decide_the_same(nodes: int, batch: int, policy: str) -> None:
    cluster = _cluster(nodes)
    *on, skips = _run(cluster, batch, policy, quiet=True)
    *off, none = _run(cluster, batch, policy, quiet=False)
    assert none == 0
    assert skips > 100  # queues were left out, or this compares nothing
    starts_on, starts_off = on[0], off[0]
    assert len(starts_on) == len(starts_off) > 0
    assert starts_on == starts_off
    assert on[1:] == off[1:]  # records (times, cores), step times, summary
