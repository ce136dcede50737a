"""tangram's dynamic batching of GPU service calls in the simulator (issue 33 item 5):
the placed call (the leader) takes up to ``max_batch - 1`` queued calls to the same service
along (riders), one pass on the leader's GPUs, timed by the static baseline's service time
model (tangram.sim.gpubatch)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tangram.sim import generate, load_cluster, parse_cluster, parse_lines, parse_policy, simulate
from tangram.sim.cluster import ClusterError, SimService
from tangram.sim.engine import Engine
from tangram.sim.gpubatch import pass_seconds

ROOT = Path(__file__).resolve().parents[1]


def cluster(max_batch: int, gain: float = 1.0, gpus: int = 1, static_batch: int = 1) -> Any:
    """One node of ``gpus`` GPUs; service ``judge`` batches ``max_batch`` calls a pass."""
    return parse_cluster(
        {
            "gpu_node": [{"count": 1, "gpus": gpus, "gpu_mem_gb": 80, "h2d_gbps": 10}],
            "service": [
                {"name": "judge", "mem_gb": 10, "static_gpus": gpus, "max_batch": max_batch}
            ],
            "baselines": {"static_max_batch": static_batch, "static_batch_gain": gain},
        },
        "<test>",
    )


def calls(*t1: float, at: tuple[float, ...] = ()) -> Any:
    """One trajectory per call to ``judge`` on one GPU (``t1`` seconds alone), arriving at
    ``at[i]`` (0 when not given)."""
    lines = []
    for i, t in enumerate(t1):
        action = {"kind": "service", "service": "judge", "gpus": [1], "t1_s": t}
        arrival = at[i] if i < len(at) else 0.0
        trajectory = {"id": f"t{i}", "task": "t", "arrival_s": arrival, "mem_gb": 1}
        lines.append(json.dumps({**trajectory, "steps": [{"action": action}]}))
    return parse_lines(lines)


def run(spec: Any, trace: Any, policy: str = "tangram") -> Engine:
    engine = Engine(spec, trace, parse_policy(policy), check=True)
    engine.run()
    return engine


def test_pass_seconds_is_the_static_replicas_last_completion() -> None:
    # the same calls started together on one static replica that batches them all: the
    # last one's ACT is the pass (processor sharing, the same model)
    t1 = (2.0, 3.0, 5.0, 5.0)
    for gain in (1.0, 2.0, 4.0):
        static = simulate(
            cluster(1, gain, static_batch=len(t1)), calls(*t1), parse_policy("static-services")
        )
        rho = [min(1.0 / gain, 1.0)] * len(t1)  # on one GPU E(1) = 1
        assert max(static.acts) == pytest.approx(pass_seconds(t1, rho))
    # by hand, gain 2 (rho 0.5): 4 calls at 2.5x for 2 s, 3 at 2x for 1 s, 2 at 1.5x for 2 s
    assert pass_seconds(t1, [0.5] * 4) == pytest.approx(2 * 2.5 + 1 * 2.0 + 2 * 1.5)
    assert pass_seconds((3.0,), [0.5]) == 3.0  # alone: its own time


def test_batches_form_and_riders_finish_with_the_leader() -> None:
    # one GPU, three calls at 0: the first placed takes the other two along (max_batch 4)
    engine = run(cluster(4, gain=2.0), calls(2.0, 2.0, 2.0))
    assert engine.batcher is not None
    assert (engine.batcher.batches, engine.batcher.riders) == (1, 2)
    recs = engine.records
    assert len(recs) == 3 and not any(r.failed for r in recs)
    restore = recs[0].restore_s
    assert restore > 0  # the leader restores the service; the riders wait for it too
    for r in recs:  # one pass: 3 calls of 2 s at 1 + 0.5 * 2 = 2x
        assert (r.start_s, r.queue_s, r.restore_s) == (0.0, 0.0, restore)
        assert r.exec_s == pytest.approx(4.0)
        assert r.units == 1
    # the GPU was busy for the pass once, not once per call
    summary = simulate(cluster(4, gain=2.0), calls(2.0, 2.0, 2.0), parse_policy("tangram"))
    assert summary.summary["busy_unit_s"]["gpu"] == pytest.approx(4.0)
    # without batching the same calls run one after another: 2, 4, 6 s (+ the restore)
    serial = run(cluster(1, gain=2.0), calls(2.0, 2.0, 2.0))
    assert serial.batcher is None
    assert sorted(round(r.act_s - restore, 6) for r in serial.records) == [2.0, 4.0, 6.0]


def test_max_batch_is_respected() -> None:
    # five calls, at most two a pass, on one GPU: passes of 2, 2 and 1 one after another
    engine = run(cluster(2, gain=2.0), calls(*[2.0] * 5))
    assert engine.batcher is not None
    assert (engine.batcher.batches, engine.batcher.riders) == (2, 2)
    starts: dict[float, int] = {}
    for r in engine.records:
        starts[r.start_s] = starts.get(r.start_s, 0) + 1
    assert sorted(starts.values()) == [1, 2, 2]
    restore = min(r.restore_s for r in engine.records if r.restore_s > 0)
    # 2 calls at 1.5x: 3 s a pass; the service stays resident after the first
    ends = sorted(round(r.act_s, 6) for r in engine.records)
    first = round(restore + 3.0, 6)
    assert ends == [first, first, first + 3.0, first + 3.0, first + 5.0]


def test_riders_come_from_the_queue_of_the_same_service_only() -> None:
    spec = parse_cluster(
        {
            "gpu_node": [{"count": 1, "gpus": 1, "gpu_mem_gb": 80, "h2d_gbps": 10}],
            "service": [
                {"name": "judge", "mem_gb": 10, "max_batch": 8},
                {"name": "other", "mem_gb": 10, "max_batch": 8},
            ],
            "baselines": {"static_batch_gain": 2.0},
        },
        "<test>",
    )
    lines = []
    for i, name in enumerate(("judge", "other", "judge", "other")):
        action = {"kind": "service", "service": name, "gpus": [1], "t1_s": 2.0}
        lines.append(json.dumps({"id": f"t{i}", "task": "t", "steps": [{"action": action}]}))
    engine = run(spec, parse_lines(lines))
    assert engine.batcher is not None
    assert (engine.batcher.batches, engine.batcher.riders) == (2, 2)
    by_start: dict[float, set[str]] = {}
    for r in engine.records:
        by_start.setdefault(r.start_s, set()).add(r.action_id)
    # each pass holds the calls of one service: t0 + t2 (judge), t1 + t3 (other)
    assert sorted(sorted(ids) for ids in by_start.values()) == [
        ["t0#0", "t2#0"],
        ["t1#0", "t3#0"],
    ]


def test_a_call_that_arrives_later_waits_for_the_next_pass() -> None:
    # t1 arrives while t0's pass runs: no open batch to join, it leads the next pass
    engine = run(cluster(8, gain=2.0), calls(2.0, 2.0, at=(0.0, 0.5)))
    assert engine.batcher is not None and engine.batcher.riders == 0
    first, second = sorted(engine.records, key=lambda r: r.start_s)
    assert second.start_s == pytest.approx(first.act_s)


def test_max_batch_one_gives_todays_summaries() -> None:
    base = load_cluster(ROOT / "config" / "cluster-small.toml")
    trace = generate("mopd+search", base, 48, seed=3)
    today = simulate(base, trace, parse_policy("tangram"), check=True)
    # max_batch = 1 written out: no batcher, the same run
    ones = replace(base, services=tuple(replace(s, max_batch=1) for s in base.services))
    assert simulate(ones, trace, parse_policy("tangram"), check=True).summary == today.summary
    # a batcher built (one service batches) but no call rides: the same run through the hook
    spare = replace(base, services=(*base.services, SimService("spare", 8.0, max_batch=64)))
    engine = Engine(spare, trace, parse_policy("tangram"), check=True)
    assert engine.batcher is not None
    assert engine.run().summary == today.summary
    assert engine.batcher.batches == 0
    # batching every service changes the run, and every call still completes
    batched = replace(base, services=tuple(replace(s, max_batch=16) for s in base.services))
    eng = Engine(batched, trace, parse_policy("tangram"), check=True)
    result = eng.run()
    assert eng.batcher is not None and eng.batcher.riders > 0
    assert result.summary["actions"] == today.summary["actions"]
    assert result.summary["failed"] == today.summary["failed"] == 0
    # static-services never uses tangram's batcher
    assert Engine(batched, trace, parse_policy("static-services")).batcher is None


def test_max_batch_in_the_cluster_file() -> None:
    assert cluster(16).services[0].max_batch == 16
    assert load_cluster(ROOT / "config" / "cluster-small.toml").services[0].max_batch == 1
    for bad in (0, 1.5, -1):
        with pytest.raises(ClusterError, match="max_batch"):
            cluster(bad)  # type: ignore[arg-type]
