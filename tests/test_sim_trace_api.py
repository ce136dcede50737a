"""Traces can say that an exec holds cores and an API slot together (issue 34): ``"api"`` on
an ``exec`` action, as the daemon's exec arg ``api``, is simulated with joint admission."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import tomllib
from click.testing import CliRunner

from tangram.sim.cli import simulate
from tangram.sim.cluster import parse_cluster
from tangram.sim.engine import Engine, SimError
from tangram.sim.policy import parse_policy
from tangram.sim.trace import TraceError, dump_trace, parse_lines, parse_trajectory

CLUSTER = """
step_train_s = 0.0
[[cpu_node]]
count = 1
cores = 8
mem_gb = 64

[[api]]
name = "search"
concurrency = 1
"""


def line(tid: str, action: dict, arrival_s: float = 0.0) -> str:
    return json.dumps({"id": tid, "arrival_s": arrival_s, "steps": [{"action": action}]})


def run(lines: list[str], cluster: str = CLUSTER, policy: str = "tangram") -> Engine:
    spec = parse_cluster(tomllib.loads(cluster), "test")
    eng = Engine(spec, parse_lines(lines), parse_policy(policy), check=True)
    eng.run()
    return eng


def test_two_cores_and_api_actions_run_one_after_the_other():
    """Eight free cores, but one slot of `search`: the second waits for the first to end."""
    action = {"kind": "exec", "cpu": 2, "api": "search", "dur_s": 3.0, "tag": "tool"}
    eng = run([line("a", action), line("b", action)])
    first, second = sorted(eng.records, key=lambda r: r.start_s)
    assert first.start_s == 0.0 and first.units == 2
    assert second.start_s == pytest.approx(3.0) and second.queue_s == pytest.approx(3.0)
    assert not first.failed and not second.failed


def test_a_quota_window_holds_them_to_one_start_per_window():
    """Concurrency 4 but one grant per 2 s window: each waits for the next window to open
    (the simulator wakes the CPU queues then; before, it stalled with them queued)."""
    cluster = CLUSTER.replace("concurrency = 1", "concurrency = 4\nquota = 1\nperiod_s = 2")
    action = {"kind": "exec", "cpu": 1, "api": "search", "dur_s": 0.5}
    eng = run([line(t, action) for t in "abc"], cluster)
    assert sorted(r.start_s for r in eng.records) == [0.0, 2.0, 4.0]


def test_without_api_they_run_together():
    """The same two actions without `api`: both start at once (the cores are free)."""
    action = {"kind": "exec", "cpu": 2, "dur_s": 3.0}
    eng = run([line("a", action), line("b", action)])
    assert [r.start_s for r in eng.records] == [0.0, 0.0]


def test_a_plain_exec_is_not_held_back_by_the_api():
    """An exec without `api` starts beside the one holding the slot."""
    holds = {"kind": "exec", "cpu": 2, "api": "search", "dur_s": 3.0}
    eng = run([line("a", holds), line("b", holds), line("c", {"kind": "exec", "dur_s": 1.0})])
    starts = {r.action_id.split("#")[0]: r.start_s for r in eng.records}
    assert starts == {"a": 0.0, "b": pytest.approx(3.0), "c": 0.0}


@pytest.mark.parametrize("policy", ["k8s", "baseline"])
def test_under_k8s_the_pods_command_retries_for_the_slot(policy: str) -> None:
    """Under the `k8s` pods (and `baseline`) there is no joint admission: each exec runs in
    its own pod, whose command takes the API slot or, refused, backs off and tries again
    (as `api-retry` does); the slot is still never held twice, and it is given back."""
    action = {"kind": "exec", "cpu": 2, "api": "search", "dur_s": 3.0}
    eng = run([line("a", action), line("b", action)], policy=policy)
    first, second = sorted(eng.records, key=lambda r: r.start_s)
    assert not first.failed and not second.failed
    assert second.start_s >= first.start_s + first.exec_s  # one slot: one at a time
    assert second.queue_s > first.queue_s  # the second backed off
    assert eng.apis["api:search"].in_use == 0 and eng.apis["api:search"].leases() == ()


def test_under_k8s_without_api_the_pods_run_together() -> None:
    """The same two execs without `api` under `k8s`: both pods run theirs at once."""
    action = {"kind": "exec", "cpu": 2, "dur_s": 3.0}
    eng = run([line("a", action), line("b", action)], policy="k8s")
    first, second = sorted(eng.records, key=lambda r: r.start_s)
    assert second.start_s < first.start_s + first.exec_s


def test_the_field_round_trips_and_is_validated():
    t = parse_trajectory(
        {"id": "t", "steps": [{"action": {"kind": "exec", "api": "search", "dur_s": 1}}]}
    )
    (a,) = t.actions()
    assert a.template.key == "cpu" and a.template.extra == (("api:search", 1),)
    out = io.StringIO()
    dump_trace([t], out)
    (again,) = parse_lines(out.getvalue().splitlines())
    assert again == t
    for bad in ("", 3, " search", None):
        raw = {"kind": "exec", "api": bad, "dur_s": 1}
        with pytest.raises(
            TraceError,
            match=r"t.jsonl:1: steps\[0\]\.action\.api: expected the name of an \[\[api\]\]",
        ):
            parse_lines([line("t", raw)], "t.jsonl")
    with pytest.raises(TraceError, match=r"unknown key\(s\) \['api'\] for kind 'service'"):
        parse_lines([line("t", {"kind": "service", "service": "s", "api": "x", "dur_s": 1})])


def test_an_api_the_cluster_does_not_define_is_an_error_naming_it():
    raw = {"kind": "exec", "api": "nosuch", "dur_s": 1.0}
    with pytest.raises(SimError, match=r"calls API 'nosuch'.*\(APIs: search\)"):
        run([line("t", raw)])


def test_simulate_cli_with_a_cores_and_api_trace(tmp_path: Path):
    (tmp_path / "c.toml").write_text(CLUSTER)
    action = {"kind": "exec", "cpu": 1, "api": "search", "dur_s": 2.0, "tag": "tool"}
    (tmp_path / "t.jsonl").write_text("\n".join([line("a", action), line("b", action)]) + "\n")
    args = ["--cluster", str(tmp_path / "c.toml"), "--trace", str(tmp_path / "t.jsonl")]
    res = CliRunner().invoke(simulate, [*args, "--policy", "tangram", "--json", "--quiet"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)["policies"]["tangram"]
    assert summary["actions"] == 2 and summary["failed"] == 0
    # one slot: the second waits the first's 2 s; ACT 2 s and 4 s
    assert summary["avg_act_s"] == pytest.approx(3.0)
