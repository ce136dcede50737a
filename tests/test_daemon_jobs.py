"""Jobs on a real ``tangramd up`` (issue 34): the job on every exec, ``jobs --json``, the
job in ``queue``/``story``/``exec`` JSON, fair share by priority under contention."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import running_daemon

from tangram.client import AsyncClient
from tangram.protocol.errors import BadRequest
from tangram.testing import spawn_daemon, wait_for
from tangramd.config import ConfigError, load_config

CORES = sorted(os.sched_getaffinity(0))[:2]
CONFIG = f"""
[cpu]
cores = {CORES}

[[job]]
name = "grpo-a"
weight = 2.0

[[job]]
name = "eval"
priority = 1
max_cores = 8
"""
JOB_FIELDS = {"name", "weight", "priority", "queued", "running", "cores", "gpus", "share"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with running_daemon(tmp_path_factory.mktemp("jobs"), config=CONFIG) as d:
        yield d


def ctl(daemon, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tangramctl.main", "--socket", daemon.socket, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_jobs_json_lists_configured_and_seen_jobs(daemon):
    res = ctl(daemon, "exec", "--json", "--", "true", env={"TANGRAM_JOB": "rollout-7"})
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["job"] == "rollout-7"
    res = ctl(daemon, "jobs", "--json")
    assert res.returncode == 0, res.stderr
    jobs = {j["name"]: j for j in json.loads(res.stdout)["jobs"]}
    assert {"default", "grpo-a", "eval", "rollout-7"} <= set(jobs)
    for row in jobs.values():
        assert JOB_FIELDS | {"act_p50", "act_p99"} <= set(row)
    assert jobs["grpo-a"]["weight"] == 2.0
    assert jobs["eval"]["priority"] == 1 and jobs["eval"]["max_cores"] == 8
    assert jobs["rollout-7"]["act_p50"] is not None  # its exec finished
    assert jobs["grpo-a"]["act_p50"] is None  # none yet


def test_job_in_queue_and_story_json_and_a_bad_job_name(daemon):
    with daemon.client(job="grpo-a") as c:
        assert c.exec("true").outcome == "ok"
        with pytest.raises(BadRequest, match="job"):
            c.exec("true", job="no spaces allowed")

    async def scenario():
        c = AsyncClient(daemon.socket, job="grpo-a")
        first = asyncio.ensure_future(c.exec("sleep 6", cpus=2))  # while two ctl calls run
        with daemon.client() as look:
            await asyncio.to_thread(wait_for, lambda: look.queue()["running"], 20, "running")
            second = asyncio.ensure_future(c.exec("true", job="eval"))
            await asyncio.to_thread(wait_for, lambda: look.queue()["waiting"], 20, "waiting")
        queue = await asyncio.to_thread(ctl_json, daemon, "queue")
        story = await asyncio.to_thread(ctl_json, daemon, "story", queue["waiting"][0]["action_id"])
        await asyncio.gather(first, second)
        await c.close()
        return queue["running"], queue["waiting"], story

    running, waiting, story = asyncio.run(scenario())
    assert running[0]["job"] == "grpo-a"
    assert waiting[0]["job"] == "eval"
    assert story["job"] == "eval"
    assert "job=eval" in json.dumps(story["events"])


def ctl_json(daemon, *args: str) -> dict:
    res = ctl(daemon, *args, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_a_priority_job_passes_a_backlog(daemon):
    """Two cores, six 2 s sleeps of job `bulk` submitted first (two run, four wait); then
    two short ones of `eval` (priority 1): both start at the next free cores, before any
    of the bulk backlog."""

    async def scenario():
        c = AsyncClient(daemon.socket)
        starts: list[tuple[str, float]] = []

        async def one(job: str, cmd: str):
            sent = time.monotonic()
            r = await c.exec(cmd, job=job)
            assert r.outcome == "ok", r
            starts.append((job, sent + r.queue_s))

        bulk = [asyncio.ensure_future(one("bulk", "sleep 2")) for _ in range(6)]
        with daemon.client() as look:
            await asyncio.to_thread(
                wait_for, lambda: len(look.queue()["waiting"]) >= 4, 30, "the bulk backlog"
            )
        eval_ = [asyncio.ensure_future(one("eval", "sleep 0.2")) for _ in range(2)]
        await asyncio.gather(*bulk, *eval_)
        await c.close()
        return sorted(starts, key=lambda s: s[1])

    starts = asyncio.run(scenario())
    order = [job for job, _ in starts]
    assert order[:2] == ["bulk", "bulk"], starts  # the two that ran at once
    assert order[2:4] == ["eval", "eval"], starts  # then eval, before the backlog


def test_bad_job_config_names_the_key(tmp_path: Path):
    p = tmp_path / "t.toml"
    p.write_text('[[job]]\nname = "a"\nweight = 0\n')
    with pytest.raises(ConfigError, match=r"job\[0\]\.weight"):
        load_config(p, {})
    p.write_text('[[job]]\nname = "a"\npriorty = 1\n')
    with pytest.raises(ConfigError, match=r"job\[0\]\.priorty.*unknown key"):
        load_config(p, {})
    # the daemon refuses to start on it, with the same line
    with pytest.raises(RuntimeError, match=r"exited early[\s\S]*job\[0\]\.priorty"):
        spawn_daemon(tmp_path / "d", p.read_text())
