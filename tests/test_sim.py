"""Simulator: determinism, conservation, hand-computed ACTs, trace and cluster parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tangram.sched import LoadMeter
from tangram.sim import (
    WORKLOADS,
    Engine,
    generate,
    load_trace,
    parse_cluster,
    parse_lines,
    parse_policy,
    simulate,
)
from tangram.sim.cluster import ClusterError, load_cluster
from tangram.sim.engine import SimError
from tangram.sim.policy import PolicyError
from tangram.sim.report import to_json
from tangram.sim.trace import TraceError, dump_trace
from tangram.sim.workloads import WorkloadError
from tangramctl.simulate import simulate as simulate_cmd

ROOT = Path(__file__).resolve().parents[1]
TRACES = Path(__file__).parent / "data" / "traces"
SMALL = ROOT / "config" / "cluster-small.toml"
POLICIES = (
    "tangram",
    "tangram-eft",
    "tangram-backfill",
    "baseline",
    "k8s",
    "static-services",
    "api-retry",
    "fixed-dop:2",
)


def cluster(**over: object) -> object:
    """A one-node cluster for hand-computed cases (4 cores, one 8-GPU node, one API)."""
    doc: dict[str, object] = {
        "step_train_s": 10.0,
        "cpu_node": [{"count": 1, "cores": 4, "numa": 1, "mem_gb": 64}],
        "gpu_node": [{"count": 1, "gpus": 8, "gpu_mem_gb": 80, "h2d_gbps": 10}],
        "service": [{"name": "judge", "mem_gb": 10, "static_gpus": 4, "static_replicas": 1}],
        "api": [{"name": "search", "concurrency": 1, "quota": 0, "period_s": 60}],
        "baselines": {"k8s_pod_cores": 2, "k8s_pod_start_s": 1.0, "api_retry_backoff_s": 1.5},
    }
    doc.update(over)
    return parse_cluster(doc, "<test>")


def acts(result: object) -> list[float]:
    return sorted(round(a, 3) for a in result.acts)  # type: ignore[attr-defined]


def line(tid: str, steps: list[dict[str, object]], **extra: object) -> str:
    return json.dumps(
        {"id": tid, "task": "t", "arrival_s": 0.0, "mem_gb": 1, "steps": steps, **extra}
    )


# ----------------------------------------------------------------------------- exact ACTs


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        # pods of 2 cores start after 1 s; each test run at DoP 2: 8 / (0.9 * 2) = 4.444 s
        ("k8s", [5.444, 5.444]),
        # action-level sharing: DPArrange splits the 4 cores 2 + 2 (4.444 s each) since
        # evicting b (a at 3 cores: 3.81 s, b at 1 core: 8 s) costs more
        ("tangram", [4.444, 4.444]),
        # fixed DoP 4: a takes all 4 cores (E=0.5: 4 s), b waits for them: 4 + 4
        ("fixed-dop:4", [4.0, 8.0]),
        ("fixed-dop:2", [4.444, 4.444]),
        # fixed DoP 1: both at one core, 8 s each
        ("fixed-dop:1", [8.0, 8.0]),
    ],
)
def test_two_elastic_trajectories_on_four_cores(policy: str, expected: list[float]) -> None:
    """Two elastic test runs on a 4-core node get the hand-computed ACT under each policy."""
    trace = load_trace(TRACES / "two-elastic.jsonl")
    result = simulate(cluster(), trace, parse_policy(policy), check=True)
    assert acts(result) == expected


def test_generation_and_pod_start_enter_step_time() -> None:
    """Generation time separates actions; k8s adds pod start to the first action only."""
    steps = [
        {"gen_s": 1.0},
        {"action": {"kind": "exec", "dur_s": 0.5}},
        {"gen_s": 2.0},
        {"action": {"kind": "exec", "dur_s": 1.0}},
    ]
    trace = parse_lines([line("a", steps)])
    tangram = simulate(cluster(), trace, parse_policy("tangram"), check=True)
    k8s = simulate(cluster(), trace, parse_policy("k8s"), check=True)
    assert acts(tangram) == [0.5, 1.0]
    assert tangram.summary["step_s"] == pytest.approx(1 + 0.5 + 2 + 1 + 10.0)
    assert acts(k8s) == [1.0, 1.5]
    assert k8s.summary["step_s"] == pytest.approx(1 + 1.5 + 2 + 1 + 10.0)
    # the pod holds 2 cores from creation (t=1) to the trajectory's end (t=5.5)
    assert k8s.summary["reserved_unit_s"]["cpu"] == pytest.approx(2 * 4.5)
    assert tangram.summary["reserved_unit_s"]["cpu"] == pytest.approx(1.5)


def test_k8s_scheduler_rate_and_exec_cost() -> None:
    """At 1 pod/s the second pod binds 1 s later; each exec pays the per-exec cost first."""
    steps = [{"action": {"kind": "exec", "dur_s": 1.0}}]
    trace = parse_lines([line("a", steps), line("b", steps)])
    knobs = {"k8s_pod_cores": 2, "k8s_pod_start_s": 1.0, "k8s_sched_pods_per_s": 1.0}
    slow = cluster(baselines={**knobs, "k8s_exec_overhead_s": 0.25})
    # a: bound at 0, ready at 1, exec cost 0.25, runs 1 s; b: bound at 1 (one bind a second)
    assert acts(simulate(slow, trace, parse_policy("k8s"), check=True)) == [2.25, 3.25]
    free = cluster(baselines={**knobs, "k8s_sched_pods_per_s": 0})
    assert acts(simulate(free, trace, parse_policy("k8s"), check=True)) == [2.0, 2.0]


def test_api_queue_versus_retry() -> None:
    """With concurrency 1, tangram queues the second call; api-retry retries after back-off."""
    call = [{"action": {"kind": "api", "api": "search", "dur_s": 1.0}}]
    trace = parse_lines([line("a", call), line("b", call)])
    assert acts(simulate(cluster(), trace, parse_policy("tangram"), check=True)) == [1.0, 2.0]
    # b is refused at 0, retries at 1.5 (back-off 1.5 s) and runs until 2.5
    assert acts(simulate(cluster(), trace, parse_policy("api-retry"), check=True)) == [1.0, 2.5]


def test_gpu_restore_versus_static_replica() -> None:
    """Tangram restores the service on 8 GPUs (0.125 s) and runs at DoP 8; static uses 4."""
    call = [
        {
            "action": {
                "kind": "service",
                "service": "judge",
                "gpus": [1, 2, 4, 8],
                "t1_s": 4.0,
                "eff": {"1": 1, "2": 1, "4": 1, "8": 1},
            }
        }
    ]
    trace = parse_lines([line("a", call)])
    tangram = simulate(cluster(), trace, parse_policy("tangram"), check=True)
    static = simulate(cluster(), trace, parse_policy("static-services"), check=True)
    assert acts(tangram) == [0.625]
    assert tangram.summary["avg_restore_s"] == pytest.approx(0.125)
    assert acts(static) == [1.0]


def test_steps_wait_for_previous_step_plus_training() -> None:
    """Step 1 trajectories arrive step_train_s after step 0's last trajectory ends."""
    act = {"action": {"kind": "exec", "dur_s": 2.0}}
    trace = parse_lines([line("a", [act]), line("b", [act], step=1, arrival_s=0.5)])
    result = simulate(cluster(), trace, parse_policy("tangram"), check=True)
    assert result.summary["steps_by_task"] == {"t": [12.0, 12.5]}
    assert result.summary["makespan_s"] == pytest.approx(2 + 10 + 0.5 + 2)


# ----------------------------------------------------------------------------- properties


def test_same_seed_gives_identical_json() -> None:
    """The same workload and seed give byte-identical JSON; another seed does not."""
    c = load_cluster(SMALL)

    def simulated_json(seed: int) -> str:
        trace = generate("mopd+search", c, 6, seed=seed)
        return to_json([simulate(c, trace, parse_policy(p)) for p in ("tangram", "baseline")])

    assert simulated_json(3) == simulated_json(3)
    assert simulated_json(3) != simulated_json(4)


@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_action_completes_once_within_capacity(workload: str) -> None:
    """Under every policy each trace action completes exactly once and pools stay valid."""
    c = load_cluster(SMALL)
    trace = generate(workload, c, 6, seed=1, steps=2)
    expected = sorted(
        f"{t.id}#{i}" for t in trace for i, s in enumerate(t.steps) if not isinstance(s, float)
    )
    n = len(expected)
    for policy in POLICIES:
        engine = Engine(c, trace, parse_policy(policy), check=True)  # validates every event
        result = engine.run()
        assert sorted(r.action_id for r in engine.records) == expected, policy
        assert result.summary["actions"] == n, policy
        assert result.summary["failed"] == 0, policy
        assert len(result.acts) == n, policy


class CountingMeter(LoadMeter):
    """A load meter that also counts the elastic arrivals it was told about."""

    def __init__(self) -> None:
        super().__init__()
        self.elastic_arrivals = 0

    def submitted(self, pool_id: str, now: float, elastic: bool) -> None:
        self.elastic_arrivals += elastic
        super().submitted(pool_id, now, elastic)


def test_engine_feeds_the_load_meter() -> None:
    """The engine reports elastic arrivals, starts and finishes to the priced rule's meter."""
    c = load_cluster(SMALL)
    engine = Engine(c, generate("ai-coding", c, 6, seed=1), parse_policy("tangram"), check=True)
    engine.meter = meter = CountingMeter()
    engine.run()
    assert meter.elastic_arrivals == 6  # one test run per trajectory
    for pid in engine.cpu:
        load = meter.load(pid, engine.now)
        assert (load.elastic_running, load.elastic_units) == (0, 0)  # every start finished


def test_generated_trace_round_trips(tmp_path: Path) -> None:
    """A generated trace written to a file parses back to the same trajectories."""
    c = load_cluster(SMALL)
    trace = generate("ai-coding", c, 3, seed=2)
    path = tmp_path / "t.jsonl"
    with open(path, "w", encoding="utf-8") as fp:
        dump_trace(trace, fp)
    assert load_trace(path) == trace


# ----------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "invalid JSON"),
        ('{"id": "x", "steps": []}', "steps"),
        ('{"id": "x", "steps": [{"gen_s": -1}]}', "gen_s"),
        ('{"id": "x", "steps": [{"action": {"kind": "exec"}}]}', "dur_s"),
        ('{"id": "x", "steps": [{"action": {"kind": "exec", "cpu": [4, 2], "dur_s": 1}}]}', "min"),
        ('{"id": "x", "steps": [{"action": {"kind": "gpu", "dur_s": 1}}]}', "kind"),
        ('{"id": "x", "colour": 1, "steps": [{"gen_s": 1}]}', "unknown key"),
        ('{"id": "x", "steps": [{"action": {"kind": "api", "dur_s": 1}}]}', "api"),
        ('{"id": "a", "steps": [{"gen_s": 1}]}', "duplicate"),
    ],
)
def test_parser_rejects_malformed_line_with_its_number(bad: str, message: str) -> None:
    """A malformed trace line is rejected with the source, its line number and the field."""
    good = '{"id": "a", "steps": [{"gen_s": 1}]}'
    with pytest.raises(TraceError) as err:
        parse_lines(["# comment", good, bad], "x.jsonl")
    assert str(err.value).startswith("x.jsonl:3:")
    assert message in str(err.value)


def test_unknown_service_names_trace_and_cluster() -> None:
    """A trace calling a service the cluster lacks is an error naming both."""
    call = [{"action": {"kind": "service", "service": "oracle", "dur_s": 1}}]
    with pytest.raises(SimError, match=r"'oracle'.*<test>"):
        simulate(cluster(), parse_lines([line("a", call)]), parse_policy("tangram"))


def test_cluster_errors_name_the_key() -> None:
    """Invalid cluster keys are rejected with the file and key; static overflow is an error."""
    with pytest.raises(ClusterError, match=r"cpu_node\[0\].cores"):
        parse_cluster({"cpu_node": [{"cores": 0}]}, "c.toml")
    with pytest.raises(ClusterError, match="unknown key"):
        parse_cluster({"cpu_nodes": []}, "c.toml")
    big = cluster(service=[{"name": "judge", "mem_gb": 1, "static_gpus": 8, "static_replicas": 2}])
    call = [{"action": {"kind": "service", "service": "judge", "dur_s": 1}}]
    with pytest.raises(SimError, match="too small"):
        simulate(big, parse_lines([line("a", call)]), parse_policy("baseline"))


def test_policy_names() -> None:
    """Policy names map to one manager per resource kind; unknown names are rejected."""
    base = parse_policy("baseline")
    assert (base.cpu, base.gpu, base.api) == ("k8s", "static", "retry")
    assert parse_policy("tangram-backfill").order == "backfill"
    assert parse_policy("fixed-dop:8").fixed_dop == 8
    with pytest.raises(PolicyError):
        parse_policy("fixed-dop:x")
    with pytest.raises(PolicyError):
        parse_policy("slurm")
    with pytest.raises(WorkloadError):
        generate("mopd", parse_cluster({}, "<empty>"), 1)


def test_cli_json_compares_policies(tmp_path: Path) -> None:
    """`simulate --json` prints one object with every policy's metrics and draws a plot."""
    png = tmp_path / "p.png"
    out = CliRunner().invoke(
        simulate_cmd,
        [
            "--cluster",
            str(SMALL),
            "--trace",
            str(TRACES / "mixed.jsonl"),
            "--policy",
            "tangram",
            "--policy",
            "baseline",
            "--json",
            "--quiet",
            "--plot",
            str(png),
        ],
    )
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert set(doc["policies"]) == {"tangram", "baseline"}
    for key in (
        "avg_act_s",
        "p50_act_s",
        "p99_act_s",
        "step_s",
        "busy_unit_s",
        "reserved_unit_s",
        "actions",
        "failed",
    ):
        assert key in doc["policies"]["tangram"]
    assert doc["policies"]["baseline"]["actions"] == 6
    assert doc["policies"]["baseline"]["failed"] == 0
    assert png.stat().st_size > 0


def test_cli_reports_trace_errors(tmp_path: Path) -> None:
    """A bad trace file makes the command fail with the line number, not a traceback."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "steps": [{"gen_s": 1}]}\n{"id": 3}\n')
    out = CliRunner().invoke(
        simulate_cmd, ["--cluster", str(SMALL), "--trace", str(bad), "--policy", "tangram"]
    )
    assert out.exit_code != 0
    assert "bad.jsonl:2:" in out.output


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["tangram", "baseline", "fixed-dop:16"])
def test_paper_scale_ai_coding_batch_1024_under_a_minute(policy: str) -> None:
    """The paper-scale AI-coding run at batch 1024 simulates in under 60 s per policy."""
    import time

    c = load_cluster(ROOT / "config" / "cluster-paper.toml")
    trace = generate("ai-coding", c, 1024, seed=0)
    t0 = time.perf_counter()
    result = simulate(c, trace, parse_policy(policy))
    assert time.perf_counter() - t0 < 60.0
    assert result.summary["failed"] == 0
