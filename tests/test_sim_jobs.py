"""Jobs in the simulator (issue 34): trace `job`, `tangramctl simulate --jobs`, fair share."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tangram.jobs import JobError, load_jobs, parse_jobs
from tangram.sim.cli import simulate
from tangram.sim.cluster import parse_cluster
from tangram.sim.engine import Engine
from tangram.sim.policy import parse_policy
from tangram.sim.trace import dump_trace, parse_lines, parse_trajectory

CLUSTER = """
step_train_s = 0.0
[[cpu_node]]
count = 1
cores = 4
mem_gb = 64
"""


def trace_lines(per_job: int = 8, calls: int = 6) -> list[str]:
    lines = []
    for job in ("A", "B"):
        for i in range(per_job):
            steps = [{"action": {"kind": "exec", "dur_s": 1.0, "tag": job}} for _ in range(calls)]
            lines.append(json.dumps({"id": f"{job}{i}", "job": job, "steps": steps}))
    return lines


def test_trace_job_per_trajectory_and_per_action_round_trips():
    t = parse_trajectory(
        {
            "id": "t",
            "job": "A",
            "steps": [
                {"action": {"kind": "exec", "dur_s": 1}},
                {"action": {"kind": "exec", "dur_s": 1, "job": "B"}},
            ],
        }
    )
    assert [a.template.job for a in t.actions()] == ["A", "B"]
    out = io.StringIO()
    dump_trace([t], out)
    (again,) = parse_lines(out.getvalue().splitlines())
    assert again == t
    with pytest.raises(ValueError, match="job"):
        parse_trajectory({"id": "t", "job": "", "steps": [{"gen_s": 1}]})


def test_weighted_job_gets_more_cores_in_the_simulator():
    cluster = parse_cluster(__import__("tomllib").loads(CLUSTER), "test")
    trajs = parse_lines(trace_lines())
    pol = parse_policy("tangram")
    jobs = parse_jobs([{"name": "A", "weight": 3.0}, {"name": "B", "weight": 1.0}])
    eng = Engine(cluster, trajs, pol, jobs=jobs)
    res = eng.run()
    by_job = res.summary["by_job"]
    assert set(by_job) == {"A", "B"}
    assert by_job["A"]["avg_queue_s"] < by_job["B"]["avg_queue_s"]
    # while both wait, A holds 3 of the 4 cores: in the first 10 s A starts 3x B's calls
    early = {"A": 0, "B": 0}
    for r in eng.records:
        if r.start_s < 10.0:
            early[r.job] += 1
    assert early == {"A": 30, "B": 10}


def test_simulate_cli_jobs_file(tmp_path: Path):
    (tmp_path / "c.toml").write_text(CLUSTER)
    (tmp_path / "t.jsonl").write_text("\n".join(trace_lines(2, 2)) + "\n")
    (tmp_path / "jobs.toml").write_text('[[job]]\nname = "A"\nweight = 2\npriority = 1\n')
    args = ["--cluster", str(tmp_path / "c.toml"), "--trace", str(tmp_path / "t.jsonl")]
    res = CliRunner().invoke(
        simulate,
        [*args, "--jobs", str(tmp_path / "jobs.toml"), "--policy", "tangram", "--json", "--quiet"],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    summary = out["policies"]["tangram"]
    assert set(summary["by_job"]) == {"A", "B"}
    (tmp_path / "bad.toml").write_text('[[job]]\nname = "A"\nweight = -1\n')
    res = CliRunner().invoke(
        simulate, [*args, "--jobs", str(tmp_path / "bad.toml"), "--policy", "tangram"]
    )
    assert res.exit_code != 0
    assert "job[0].weight" in res.output


@pytest.mark.parametrize(
    ("entry", "key"),
    [
        ({"weight": 1}, "job[0].name"),
        ({"name": "a b"}, "job[0].name"),
        ({"name": "a", "weight": "x"}, "job[0].weight"),
        ({"name": "a", "priority": 1.5}, "job[0].priority"),
        ({"name": "a", "max_cores": -1}, "job[0].max_cores"),
        ({"name": "a", "max_gpu": 1}, "job[0].max_gpu"),
    ],
)
def test_bad_job_entries_name_the_key(entry, key):
    with pytest.raises(JobError) as err:
        parse_jobs([entry])
    assert err.value.key == key


def test_duplicate_job_and_file_errors(tmp_path: Path):
    with pytest.raises(JobError, match="duplicate"):
        parse_jobs([{"name": "a"}, {"name": "a"}])
    p = tmp_path / "j.toml"
    p.write_text("[[jobs]]\nname = 'a'\n")
    with pytest.raises(JobError, match="unknown section"):
        load_jobs(p)
