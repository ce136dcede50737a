"""Per-job ACT statistics survive a restart (issue 34): ``jobs --json``'s ``done``,
``act_p50`` and ``act_p99`` are the same after ``tangramd up`` stops (SIGTERM) and starts
again on the same state dir; a corrupt or truncated ``job_stats.json`` is logged and the
stats start fresh; a write that fails (a full disk, a path that cannot be written) is
logged and never stops the daemon. The bounds (a window of ACTs per job, a number of
jobs) and the file's shape are checked on ``JobStats`` itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_harness import InProcessCluster, check_clean, stop_all
from harness import TEST_CONFIG, assert_clean_log

from tangram.pools.cpu import CpuCluster, CpuNodePool
from tangram.protocol.results import ExecResult, ExecSpec
from tangram.testing import spawn_daemon
from tangramd import events as ev
from tangramd.state import Core, CoreConfig
from tangramd.state.jobstats import (
    JOB_ACTS,
    MAX_JOBS,
    SAVE_EVERY_S,
    JobStats,
    parse_job_stats,
)

CORES = sorted(os.sched_getaffinity(0))[:2]
CONFIG = (
    TEST_CONFIG
    + f"""
[cpu]
cores = {CORES}

[[job]]
name = "grpo-a"
weight = 2.0
"""
)
STATS_KEYS = ("done", "act_p50", "act_p99")
CLUSTER_CONFIG = """
[cluster]
heartbeat_s = 0.25
heartbeat_timeout_s = 3
"""


def jobs_json(socket: str) -> dict[str, dict]:
    """``tangramctl jobs --json``, by job name."""
    res = subprocess.run(
        [sys.executable, "-m", "tangramctl.main", "--socket", socket, "jobs", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return {row["name"]: row for row in json.loads(res.stdout)["jobs"]}


def stats_of(rows: dict[str, dict], job: str) -> tuple:
    return tuple(rows[job][k] for k in STATS_KEYS)


def start(work: Path):
    return spawn_daemon(work, CONFIG, env={"TANGRAM_VALIDATE": "1"})


def test_job_stats_survive_a_restart(tmp_path):
    daemon = start(tmp_path)
    try:
        with daemon.client(job="grpo-a") as c:
            for i in range(5):
                assert c.exec(f"sleep 0.0{i}").outcome == "ok"
        with daemon.client(job="eval-7") as c:  # a job seen only on its actions
            for _ in range(3):
                assert c.exec("true").outcome == "ok"
        before = jobs_json(daemon.socket)
    finally:
        assert daemon.stop() == 0, daemon.log()
    assert stats_of(before, "grpo-a")[0] == 5 and stats_of(before, "eval-7")[0] == 3
    assert None not in stats_of(before, "grpo-a") + stats_of(before, "eval-7")
    saved = json.loads((tmp_path / "state" / "job_stats.json").read_text())
    assert parse_job_stats(saved)
    first_log = daemon.log()

    again = start(tmp_path)
    try:
        after = jobs_json(again.socket)
        for job in ("grpo-a", "eval-7"):
            assert stats_of(after, job) == stats_of(before, job), (job, before, after)
        assert after["eval-7"]["queued"] == after["eval-7"]["running"] == 0
        with again.client(job="eval-7") as c:  # the count goes on from there
            assert c.exec("true").outcome == "ok"
        assert jobs_json(again.socket)["eval-7"]["done"] == 4
    finally:
        assert again.stop() == 0, again.log()
    assert_clean_log(first_log)
    assert_clean_log(again.log())
    assert "job_stats_unreadable" not in again.log()


def test_a_coordinators_job_stats_survive_its_restart(tmp_path):
    """The coordinator answers ``jobs`` for the cluster: the stats of execs sent through a
    node are written when it stops and read back by the next one on its state dir."""
    with InProcessCluster(tmp_path, env={"TANGRAM_VALIDATE": "1"}) as here:
        coord = here.coordinator(CLUSTER_CONFIG)
        node = here.node(coord, "a", cpus=",".join(str(c) for c in CORES))
        for job, n in (("grpo-a", 3), ("eval-7", 2)):
            with node.client(job=job) as c:
                for _ in range(n):
                    assert c.exec("true").outcome == "ok"
        with coord.client() as c:
            before = {row["name"]: row for row in c.jobs()}
        stop_all([node, coord])
        assert stats_of(before, "grpo-a")[0] == 3 and stats_of(before, "eval-7")[0] == 2
        again = here.coordinator(CLUSTER_CONFIG)
        with again.client() as c:
            after = {row["name"]: row for row in c.jobs()}
        for job in ("grpo-a", "eval-7"):
            assert stats_of(after, job) == stats_of(before, job), (job, before, after)
        stop_all([again])
        check_clean(coord, node, again)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(None, id="truncated"),
        pytest.param(b"\x00\xffnot json at all", id="garbage"),
        pytest.param(b'{"version": 1, "jobs": [{"name": "x", "done": -1, "acts": []}]}', id="bad"),
    ],
)
def test_a_corrupt_stats_file_is_logged_and_the_stats_start_fresh(tmp_path, content):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    good = JobStats()
    for i in range(50):
        good.record("grpo-a", 0.5 + i, float(i))
    text = json.dumps(good.take()).encode()
    (state / "job_stats.json").write_bytes(text[: len(text) // 2] if content is None else content)
    daemon = start(tmp_path)
    try:
        rows = jobs_json(daemon.socket)
        assert stats_of(rows, "grpo-a") == (0, None, None)  # fresh
        with daemon.client(job="grpo-a") as c:
            assert c.exec("true").outcome == "ok"
        assert jobs_json(daemon.socket)["grpo-a"]["done"] == 1
    finally:
        assert daemon.stop() == 0, daemon.log()
    log = daemon.log()
    assert log.count('"event": "job_stats_unreadable"') == 1, log
    assert_clean_log(log)
    saved = json.loads((state / "job_stats.json").read_text())  # written anew, whole
    assert parse_job_stats(saved) and [r["done"] for r in saved["jobs"]] == [1]


def test_a_stats_file_that_cannot_be_written_is_logged_not_fatal(tmp_path):
    """``job_stats.json`` is a directory here: it cannot be read (logged, fresh) nor
    replaced (logged at each save); the daemon serves on and stops cleanly."""
    state = tmp_path / "state"
    (state / "job_stats.json").mkdir(parents=True)
    os.chmod(state, 0o700)
    daemon = start(tmp_path)
    try:
        with daemon.client(job="grpo-a") as c:
            assert c.exec("true").outcome == "ok"
        assert jobs_json(daemon.socket)["grpo-a"]["done"] == 1
    finally:
        assert daemon.stop() == 0, daemon.log()
    log = daemon.log()
    assert '"event": "job_stats_unreadable"' in log
    assert '"event": "job_stats_unwritable"' in log  # the save at shutdown
    assert_clean_log(log)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs: needs root")
def test_a_full_disk_loses_the_save_not_the_daemon(tmp_path):
    """The state dir on a full tmpfs: the saves at shutdown (the environments' records,
    then the stats, refused by the same back-off) are logged once (``disk_full``) and the
    daemon still stops cleanly."""
    from test_disk_full import fill, small_disk

    with small_disk(tmp_path / "state") as disk:
        daemon = start(tmp_path)
        try:
            with daemon.client(job="grpo-a") as c:
                assert c.exec("true").outcome == "ok"
            fill(disk)
        finally:
            code = daemon.stop()
        log = daemon.log()
        assert code == 0, log
        assert log.count('"event": "disk_full"') == 1, log  # once for every write refused
        saved = disk / "job_stats.json"  # never half written: absent, or a save before
        assert not saved.exists() or parse_job_stats(json.loads(saved.read_text()))
        assert_clean_log(log)


# ------------------------------------------------------------------ the core, pure
def test_the_core_asks_for_a_save_a_few_seconds_after_an_action_ends():
    """An ended action makes a save due ``SAVE_EVERY_S`` later (one for a burst), the tick
    then returns ``PersistJobStats`` with the file's content, and a loaded file comes back
    as the same rows."""
    cluster = CpuCluster([CpuNodePool("local", [[0, 1]], 8 << 30)])
    core = Core(cluster, {}, CoreConfig())
    (create,) = core.handle(ev.OpenEnv(token=1), 0.0)
    core.handle(ev.EnvCreated(env_id=create.env_id), 0.0)
    for i, t in enumerate((1.0, 2.0)):
        core.handle(ev.SubmitExec(spec=ExecSpec(cmd="true", env=create.env_id), token=2 + i), t)
        (run,) = core.handle(ev.Tick(), t)
        core.handle(ev.ExecFinished(run.action_id, ExecResult("ok", exit_code=0)), t + 0.5)
    assert core.handle(ev.Tick(), 2.5) == []  # (the pass the end made due)
    assert core.next_wakeup(3.0) == 1.5 + SAVE_EVERY_S  # from the first end, not the last
    assert core.handle(ev.Tick(), 4.0) == []
    (save,) = core.handle(ev.Tick(), 1.5 + SAVE_EVERY_S)
    assert isinstance(save, ev.PersistJobStats) and parse_job_stats(save.stats)
    assert core.handle(ev.Tick(), 10.0) == []  # saved: nothing more to write
    assert core.next_wakeup(10.0) > 1000  # (only the environment's idle TTL is left)
    rows = {r["name"]: r for r in core.read.job_rows()}
    again = Core(cluster, {}, CoreConfig())
    again.handle(ev.JobStatsLoaded(stats=json.loads(json.dumps(save.stats))), 0.0)
    assert {r["name"]: r for r in again.read.job_rows()} == rows
    assert rows["default"]["done"] == 2 and rows["default"]["act_p50"] == 0.5


# ------------------------------------------------------------------ the bounds, pure
def test_each_job_keeps_a_window_of_acts_and_a_count():
    stats = JobStats()
    for i in range(JOB_ACTS + 10):
        stats.record("a", float(i), 0.0)
    assert stats.count("a") == JOB_ACTS + 10
    assert stats.get("a") == tuple(float(i) for i in range(10, JOB_ACTS + 10))
    assert stats.due == 5.0 and stats.dirty
    saved = stats.take()
    assert parse_job_stats(saved) and not stats.dirty and stats.due is None
    again = JobStats()
    again.load(json.loads(json.dumps(saved)))
    assert again.get("a") == stats.get("a") and again.count("a") == stats.count("a")


def test_jobs_beyond_the_bound_drop_the_least_recently_active_not_configured():
    stats = JobStats()
    stats.record("configured", 1.0, 0.0, keep={"configured"})
    for i in range(MAX_JOBS + 5):
        stats.record(f"j{i}", 1.0, 0.0, keep={"configured"})
    assert len(list(stats)) == MAX_JOBS
    assert "configured" in stats and "j0" not in stats and f"j{MAX_JOBS + 4}" in stats


def test_loading_keeps_what_this_run_recorded_on_top():
    old = JobStats()
    old.record("a", 1.0, 0.0)
    new = JobStats()
    new.record("a", 2.0, 0.0)
    new.load(old.take())
    assert new.get("a") == (1.0, 2.0) and new.count("a") == 2


@pytest.mark.parametrize(
    "data",
    [
        [],
        {"version": 2, "jobs": []},
        {"version": 1, "jobs": {}},
        {"version": 1, "jobs": [{"name": "has space", "done": 0, "acts": []}]},
        {"version": 1, "jobs": [{"name": "a", "done": 0, "acts": []}] * 2},
        {"version": 1, "jobs": [{"name": "a", "done": True, "acts": []}]},
        {"version": 1, "jobs": [{"name": "a", "done": 1, "acts": [float("nan")]}]},
        {"version": 1, "jobs": [{"name": "a", "done": 1, "acts": ["1"]}]},
        {"version": 1, "jobs": [{"name": "a", "done": 1, "acts": [1.0] * (JOB_ACTS + 1)}]},
    ],
)
def test_ill_shaped_stats_are_refused(data):
    assert not parse_job_stats(data)
